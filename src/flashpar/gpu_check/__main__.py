"""``python -m flashpar.gpu_check``: see ``flashpar.gpu_check``."""

import sys

from flashpar.gpu_check.cli import main

sys.exit(main())

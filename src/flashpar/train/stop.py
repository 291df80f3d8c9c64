"""``JobStop``: an error that every rank raises together, at the same point, with the same one-line message.

The launcher (``flashpar.train.run``) prints that message as the job's one line (no "a rank failed":
no rank failed, the job decided to stop): a non-finite step (``flashpar.train.nonfinite``), a checkpoint
that cannot be written (``flashpar.train.checkpoint``: a full disk, an unwritable folder, non-finite
weights).  Raised where every rank already holds the same facts (the result of a collective), so no
rank is left waiting in a collective for a peer that stopped.
"""

from __future__ import annotations


class JobStop(RuntimeError):
    """Stop the job on every rank; ``str(err)`` is the one line the launcher prints."""

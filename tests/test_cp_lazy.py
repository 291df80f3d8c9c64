"""``import flashpar.cp`` and ``import flashpar.models`` load no torch (a command's flags read ``STRATEGIES`` and
``LlamaConfig``); their torch names load on first use, and ``cp.attention`` / ``cp.shard`` stay the functions even
where their modules are imported directly (as ``flashpar.models.step_check`` imports ``flashpar.cp.attention``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

PROBE = """
import sys, types
import flashpar.cp as cp
import flashpar.models as models
from flashpar.cp import STRATEGIES
from flashpar.models import LlamaConfig
assert "torch" not in sys.modules, "torch imported"
import flashpar.cp.attention, flashpar.cp.shard  # the modules first, by name
assert "torch" in sys.modules
for name in ("attention", "shard", "gather"):
    fn = getattr(cp, name)
    assert callable(fn) and not isinstance(fn, types.ModuleType), (name, fn)
    assert fn is getattr(sys.modules["flashpar.cp." + ("attention" if name == "attention" else "shard")], name)
from flashpar.cp import CPPlan, CommCounter, attention, plan
from flashpar.models import Llama, load_hf
assert CPPlan.__module__ == "flashpar.cp.cp_plan" and Llama.__module__ == "flashpar.models.llama"
assert plan([5, 3], 2).cp_size == 2
print("ok")
"""


def test_cp_and_models_load_torch_on_first_use_and_keep_their_function_names():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]

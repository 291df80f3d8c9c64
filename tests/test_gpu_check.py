"""``make gpu-check`` rehearsed on the CPU: every part's code at tiny sizes, the report, the hard limits.

The GPU minutes are few; this proves beforehand that the command runs end to end and writes its report:
the CUDA-only tests are collected and skip themselves, the segment-attention backends are timed (and agree
with each other on a real pack), the split GEMMs are timed, the trainer runs ``--check`` and 2 steps at
world size 1 on gloo.  The measuring parts and the trainer run in this process (``--in-process``: a child
would spend more on importing torch than the part takes); the limits are tested on children of their own.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from flashpar.gpu_check.cli import main
from flashpar.gpu_check.runner import run_child
from flashpar.train.config import TrainConfig, ready


def test_dry_run_runs_every_part_and_writes_the_report(tmp_path, capsys):
    rc = main(["--dry-run", "--in-process", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    first, last = printed.splitlines()[0], printed.strip().splitlines()[-1]
    assert "4 parts" in first and "450 s at most" in first and str(tmp_path) in first  # what it will do
    assert f"report: {tmp_path / 'gpu-check.md'}" in last  # where the report is
    rep = json.loads((tmp_path / "gpu-check.json").read_text())
    parts = {p["name"]: p for p in rep["parts"]}
    assert list(parts) == ["tests", "attention", "gemm", "train"]

    tests = parts["tests"]  # collected from the checkout, skipped without a GPU
    names = [t["test"] for t in tests["result"]["tests"]]
    assert tests["status"] == "skipped" and any("test_varlen_cuda_kernel_matches_math" in n for n in names)
    default = [n for n in names if "cuda_default" in n]  # the default backend's GPU tests, the report's verdict
    assert any("test_cuda_default_backend_matches_math_on_a_long_pack" in n for n in default) and len(default) >= 4
    assert {t["outcome"] for t in tests["result"]["tests"]} == {"skipped"}
    for verdict in ("cuda_default", "varlen"):
        assert rep[verdict]["passed"] is None and rep[verdict]["detail"].startswith("skipped: needs a CUDA GPU")
    assert "; cuda_default not run; varlen not run; report:" in last

    cases = parts["attention"]["result"]["rows"]
    assert len(cases) == 2 and cases[1]["received_tokens"] > 0  # the whole pack, and one rank of a cp 2 plan
    for case in cases:
        ran = {b["backend"]: b for b in case["backends"]}
        assert set(ran) == {"flash", "math", "varlen"} and all(b["status"] == "ran" for b in ran.values())
        # float32 operands on a real pack: the backends differ by summation order only (~1e-6); a wrong key is O(1)
        assert ran["flash"]["max_abs_diff_vs_math"] < 1e-4 and ran["varlen"]["max_abs_diff_vs_math"] < 1e-4
        assert all(b["fwd_tflops"] > 0 and b["bwd_tflops"] > 0 for b in ran.values())
        assert case["dense"]["fwd_tflops"] > 0 and case["predicted_fwd_tflops"] > 0

    gemm = parts["gemm"]["result"]
    assert {(r["tp"], r["pieces"]) for r in gemm["rows"]} == {(tp, n) for tp in (2, 4) for n in (2, 3)}
    assert all(r["efficiency"] > 0 and 0 < r["predicted_efficiency"] <= 1 for r in gemm["rows"])

    train = parts["train"]["result"]
    assert train["check"]["passed"] and len(train["check"]["rows"]) >= 5
    assert train["train"]["passed"] and len(train["train"]["losses"]) == 2
    assert all(math.isfinite(x) for x in train["train"]["losses"]) and train["train"]["tokens_per_s"] > 0

    md = (tmp_path / "gpu-check.md").read_text()
    assert "One GPU cannot host two NCCL ranks" in md and "`flashpar simulate`" in md
    assert "made on the CPU" in md and "## GEMM split into N row pieces" in md
    assert "**CUDA default backend (`flash`: torch's FlashAttention-2 / memory-efficient SDPA kernels) against math " \
           "and float64: not run**" in md
    assert (tmp_path / "gpu-check.log").is_file()


def test_a_part_past_its_limit_is_killed_and_a_crash_is_recorded(tmp_path):
    hang = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    got = run_child("hang", hang, 1.0, tmp_path / "hang.json")
    assert got.status == "timeout" and "started" in got.output and got.wall_s < 30
    crash = [sys.executable, "-c", "print('about to fail'); raise SystemExit(3)"]
    got = run_child("crash", crash, 30.0, tmp_path / "crash.json")
    assert got.status == "error" and got.error == "exit status 3 and no result: about to fail"
    ok = [sys.executable, "-c", f"open({str(tmp_path / 'ok.json')!r}, 'w').write('{{\"status\": \"passed\"}}')"]
    assert run_child("ok", ok, 30.0, tmp_path / "ok.json").status == "passed"
    rows = "{\"status\": \"partial\", \"rows\": [1]}"  # what a measuring part writes after its first row
    half = [sys.executable, "-c", f"open({str(tmp_path / 'half.json')!r}, 'w').write({rows!r}); import time; "
            "time.sleep(60)"]
    got = run_child("half", half, 1.0, tmp_path / "half.json")
    assert got.status == "timeout" and got.result["rows"] == [1]


def test_cuda_runs_need_a_gpu_per_rank(monkeypatch, tmp_path):
    """One GPU cannot host two NCCL ranks: more ranks than GPUs stop before any process starts (one line)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    config = TrainConfig(device="cuda", nproc=2, dp=1, cp=2, tp=1, out=str(tmp_path))
    with pytest.raises(ValueError, match=r"--device cuda: 2 ranks on this machine need 2 GPUs \(one per rank\)"):
        ready(config, 2)

"""`flashpar train`: argument errors before any process starts, a short run and --check end to end."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch

from flashpar.cli import main
from flashpar.options import ParallelOptions
from flashpar.train.config import TrainConfig
from flashpar.train.loop import Hooks
from flashpar.train.run import launch
from train_workers import exit_at, raise_at

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")


@pytest.mark.parametrize("argv, words", [
    (["--nproc", "4", "--dp", "2", "--cp", "2", "--tp", "2"], "does not match the 4 processes"),
    (["--heads", "6", "--kv-heads", "3", "--hidden", "96"], "kv heads = 3 is not divisible by tp = 2"),
    (["--ffn", "75"], "FFN size = 75 is not divisible by tp = 2"),
    (["--seq-len", "6"], "too short"),
    (["--out", "/proc/flashpar-cannot-write"], "not writable"),
    (["--max-docs", "1", "--seq-len", "100000000"], "fewer than one global batch"),
    (["--save-every", "-1"], "save-every must be an integer >= 0, got -1"),
    pytest.param(["--device", "cuda"], "--device cuda: no CUDA device is available", marks=NO_CUDA),
])
def test_bad_arguments_stop_with_one_line(argv, words, capsys):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err


def test_train_runs_and_writes_metrics(train_runs):
    run = train_runs["train"]  # 4 steps, --save-every 2 --trace --plot (tests/train_runs.py)
    assert run.rc == 0, run.stderr[-3000:]
    out = run.out
    assert all(json.loads((out / f"trace_rank{r}.json").read_text())["traceEvents"] for r in range(4))
    assert (out / "train.png").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # forward K/V bytes measured by the executor equal what the plans say (and some move: the 256-token cap
    # cuts the long documents, whether or not the ranks share cores)
    assert all(r["kv_bytes"] == r["plan_kv_bytes"] for r in rows) and all(r["kv_bytes"] > 0 for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_loss"] < summary["first_loss"]
    # the largest rank's peak memory over the steps (CPU: the resident peak's rise): activations, gradients, AdamW
    assert summary["peak_mem_mb"] > 0 and summary["dtype"] == "fp32" and "peak memory" in run.stdout
    assert "trained 4 steps" in run.stdout
    # on CPU no MFU (no vendor peak): the model's FLOP/s; the steps' own time and the launch's, apart
    assert summary["mfu"] is None and summary["peak_flops_per_rank"] is None and summary["model_flops_per_s"] > 0
    assert all(r["mfu"] is None and r["model_flops_per_s"] > 0 for r in rows)
    assert "GFLOP/s of model math (no MFU on CPU: no vendor peak)" in run.stdout and "MFU 0" not in run.stdout
    assert 0 < summary["steps_s"] <= summary["wall_s"] and " s in steps, " in run.stdout
    # ZeRO-3's auto choices made once at set-up: the resolved options in the summary, the checkpoint and the
    # run's last lines, the same value in all three
    options = ParallelOptions(**summary["options"])
    assert options.resolved and options.zero_collective in ("ring", "doubling"), summary["options"]
    meta = json.loads((out / "checkpoints" / "step_2" / "meta.json").read_text())
    assert ParallelOptions(**meta["options"]) == options
    assert f"options: {options.describe()}" in run.stdout
    # every rank keeps its log, which starts by saying whose it is
    for r in range(4):
        assert (train_runs["resume-same"].out / f"rank{r}.log").read_text().startswith(f"rank {r} of 4: pid ")


def test_check_passes(train_runs):
    run = train_runs["check-hf"]  # --check on the sizes of a Hugging Face config.json
    assert run.rc == 0, run.stdout + run.stderr[-3000:]
    assert "PASS  q/k/v" in run.stdout and run.stdout.strip().endswith("PASS")


def test_resume_continues_the_same_loss_trajectory_on_any_mesh(train_runs):
    """4 steps straight vs 2 steps, checkpoint, and 2 more: the same losses on the same mesh (only the
    data loader, weights and AdamW moments come back: bit-identical here), and within fp32 rounding
    (1e-5 relative: other reduction orders) when resumed on (dp, cp, ulysses, tp) = (1, 2, 2, 1):
    the tp shards become Ulysses head groups."""
    names = ("train", "resume-same", "resume-ulysses", "resume-per-doc-ring")
    straight, same, other, dp2 = (train_runs[n] for n in names)
    for run in (straight, same, other, dp2):
        assert run.rc == 0, run.stderr[-3000:]
    step2 = straight.out / "checkpoints" / "step_2"
    assert json.loads((step2 / "meta.json").read_text())["sequences"] == 2
    # ZeRO-3 over dp = 2 (per_doc, ring) from the same checkpoint: other sequences per step, so only that it trains on
    assert list(dp2.losses()) == [3, 4] and "mesh dp=2 cp=2 tp=1" in dp2.stdout
    straight, same, other = straight.losses(), same.losses(), other.losses()
    assert list(same) == list(other) == [3, 4]  # --steps 4 and the rest from the checkpoint alone
    assert "the run's settings from its checkpoint" in train_runs["resume-same"].stderr
    for step in (3, 4):
        assert same[step] == pytest.approx(straight[step], rel=1e-6)
        assert other[step] == pytest.approx(straight[step], rel=1e-5)


def test_compiled_run_resumes_the_eager_runs_trajectory_and_reports_its_compilation(train_runs):
    """``--resume`` of the eager run's step 2 with ``--compile``: steps 3 and 4 compiled (every other setting the
    checkpoint's) give the eager run's losses within 1e-5 relative (fp32: inductor fuses each region's elementwise
    ops and sums the norm's squares in its own order, ~1e-7 per value; a wrong region is O(1)); the compilation is
    one line at start-up and in the summary, and nothing compiles during the steps."""
    run, straight = train_runs["resume-compiled"], train_runs["train"]
    assert run.rc == 0, run.stderr[-3000:]
    losses, eager = run.losses(), straight.losses()
    assert list(losses) == [3, 4]
    for step in (3, 4):
        assert losses[step] == pytest.approx(eager[step], rel=1e-5)
    summary = json.loads((run.out / "summary.json").read_text())
    assert summary["options"]["compile"] is True and summary["compile_s"] > 0, summary
    # the block's five regions and the loss's at its two widths (tp 2: a rank's 128 vocabulary columns, or all 256
    # where the tp ranks gather the byte vocabulary, which a step's token count decides)
    assert summary["compile_graphs"] == 7 and summary["recompiles"] == 0, summary
    # the run's last lines (rank 0's start-up line goes to the launcher's terminal, not to this test's stdout)
    assert "compile: " in run.stdout and "s at start-up, 7 graphs, not in the step times" in run.stdout
    assert "compile on" in run.stdout


def test_compiled_check_passes(train_runs):
    run = train_runs["check-compiled"]  # --check --compile on the default mesh (cp 2 x tp 2, ZeRO-3)
    assert run.rc == 0, run.stdout + run.stderr[-3000:]
    header = next(line for line in run.stdout.splitlines() if line.startswith("check: mesh"))
    assert "compiled (--compile)" in header and run.stdout.strip().endswith("PASS"), run.stdout


def test_resume_with_other_data_settings_is_refused(train_runs, tmp_path, capsys):
    checkpoints = train_runs["train"].out / "checkpoints"  # made with --seq-len 256
    assert main(["train", "--steps", "5", "--max-docs", "40", "--seq-len", "128", "--resume", str(checkpoints),
                 "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "was made with other settings: --seq-len 256 there, 128 here (leave those flags out" in err, err


def test_a_rank_that_dies_stops_the_job_with_a_clear_error(tmp_path, capsys):
    """Rank 2 exits at step 2 (a fault-injection hook, ``Hooks.before_step``): the launcher stops the others and
    says so, well within the 60 s timeout, instead of leaving ranks 0, 1 and 3 waiting for it."""
    import time

    config = TrainConfig(steps=3, seq_len=128, max_docs=40, workers=0, timeout=60.0, out=str(tmp_path))
    t0 = time.monotonic()
    rc = launch(config, hooks=Hooks(before_step=functools.partial(exit_at, rank=2, at=2)))
    assert rc == 1 and time.monotonic() - t0 < 60
    err = capsys.readouterr().err
    assert "a rank failed" in err and "exit code 17" in err, err[-2000:]


def test_a_rank_that_raises_prints_one_line_and_logs_its_traceback(tmp_path, capsys):
    """A Python exception on rank 1: one line naming the rank, the error and the log, which ends with the
    traceback (in the run's folder)."""
    config = TrainConfig(steps=2, seq_len=128, max_docs=40, workers=0, timeout=60.0, out=str(tmp_path))
    assert launch(config, hooks=Hooks(before_step=functools.partial(raise_at, rank=1, at=1))) == 1
    err = capsys.readouterr().err.strip().splitlines()
    log = tmp_path / "rank1.log"
    want = f"flashpar train: a rank failed: rank 1: RuntimeError: injected fault at step 1 (traceback: {log})"
    assert err[-1] == want, err
    assert not any("Traceback" in line for line in err), err
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "raise_at" in text, text


def test_own_model_from_a_hugging_face_folder_to_a_hugging_face_folder(train_runs):
    """The README's "Train your own model" (tests/train_runs.py ``own-model`` and ``export``): a transformers
    Llama 3.1-style folder and its BPE tokenizer, jsonl + parquet + text documents, every training feature
    on; the exported folder is one transformers loads whole, with the trained weights."""
    transformers = pytest.importorskip("transformers")
    import tokenizers
    from safetensors.torch import load_file

    from train_runs import EOD, OWN_MODEL

    run, export = train_runs["own-model"], train_runs["export"]
    assert run.rc == 0 and export.rc == 0, (run.stderr[-3000:], export.stderr[-2000:])
    rows = [json.loads(line) for line in (run.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # warm-up to 1e-3 at step 1, then cosine down to --lr-min 1e-4 at step 4
    assert rows[0]["lr"] == pytest.approx(1e-3) and rows[3]["lr"] == pytest.approx(1e-4)
    assert rows[0]["lr"] > rows[1]["lr"] > rows[2]["lr"] > rows[3]["lr"]
    assert all(0 < r["grad_norm"] < float("inf") for r in rows)
    assert ["eval_loss" in r for r in rows] == [False, True, False, True]
    summary = json.loads((run.out / "summary.json").read_text())
    assert summary["micro_batches"] == 2 and summary["peak_mem_mb"] > 0
    # the global batch: 2 micro-batches of 256 tokens on the one dp rank
    assert rows[0]["tokens_per_s"] * rows[0]["step_s"] == pytest.approx(2 * 256)
    hf, info = transformers.LlamaForCausalLM.from_pretrained(export.out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    # whole: the tokenizer loads (offline, conftest), generation stops at the run's end-of-text token, and every
    # file has a new file's ordinary mode
    tok = transformers.AutoTokenizer.from_pretrained(export.out)
    eod = tok.convert_tokens_to_ids(EOD)
    assert tok.eos_token == EOD and tok("x = 1").input_ids == tokenizers.Tokenizer.from_file(
        str(run.out.parent.parent / "path" / "to" / "llama" / "tokenizer.json")).encode("x = 1").ids
    eos = hf.generation_config.eos_token_id
    assert eod in (eos if isinstance(eos, list) else [eos]), eos
    umask = os.umask(0)
    os.umask(umask)
    assert {p.name: p.stat().st_mode & 0o777 for p in export.out.iterdir()} == dict.fromkeys(
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"],
        0o666 & ~umask)
    assert hf.config.rope_parameters["rope_type"] == "llama3" and hf.config.vocab_size == OWN_MODEL["vocab_size"]
    start = load_file(str(run.out.parent.parent / "path" / "to" / "llama" / "model.safetensors"))
    trained = hf.state_dict()
    assert set(start) == set(trained)
    moved = {n: float((trained[n] - start[n]).abs().max()) for n in start}
    # 4 AdamW steps of at most lr 1e-3 each move a weight by at most ~4e-3 (Adam's step is <= lr per element,
    # plus decay); every trained matrix moved
    assert all(0 < m < 1e-2 for n, m in moved.items() if "norm" not in n), moved

"""``flashpar bench train``: arguments, the torch peer against the single-process Llama, ``no_comm``, a smoke run.

Timings are printed by the command, never asserted here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench_train_workers import compiled_against_eager, peer_against_llama, solo_without_comm
from dist_harness import SpawnCache
from flashpar import cli, links
from flashpar.bench import train as bench_train
from flashpar.sim.bench_runs import packed_docs

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = ["--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "64", "--seq-len", "128",
        "--scale", "64", "--link-rate", "none", "--steps", "1", "--rounds", "2", "--warmup", "1"]
SOLO_MESHES = [(1, 1, 2), (1, 2, 1), (2, 1, 1)]
# (dp, cp, tp, attention): the per-(document, chunk) peer on every mesh, the dense one where cp splits documents
PEER_MESHES = {1: [(1, 1, 1, "docs")], 2: [(1, 1, 2, "docs"), (2, 1, 1, "docs"), (1, 2, 1, "dense")],
               3: [(1, 3, 1, "docs"), (1, 3, 1, "dense")], 4: [(1, 2, 2, "docs"), (2, 2, 1, "docs")]}


def _config(**kw) -> dict:
    args = cli_args(*TINY, *sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in kw.items()), []))
    return bench_train.config_of(args)


def cli_args(*argv):
    import argparse

    p = argparse.ArgumentParser()
    bench_train.add_arguments(p)
    return p.parse_args(list(argv))


def _calls(n: int) -> list:
    calls = [("peer", peer_against_llama, PEER_MESHES[n])]
    if n == 2:
        calls += [(f"solo{mesh}", solo_without_comm, _config(dp=mesh[0], cp=mesh[1], tp=mesh[2]))
                  for mesh in SOLO_MESHES]
        # 512 tokens against the 256-byte vocabulary: flashpar and baseline gather the embedding / head weights
        calls += [("solo-vocab", solo_without_comm, _config(dp=1, cp=1, tp=2, seq_len=512))]
        calls += [("compiled", compiled_against_eager)]
    return calls


spawned = SpawnCache(_calls, timeout=400.0)


# ---- arguments --------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "needle"), [
    (["--configs", "flashpar,jax"], "--configs"),
    (["--tp", "3"], "not divisible by tp"),
    (["--seq-len", "100"], "multiple of 2 x cp"),
    (["--ulysses", "2", "--cp", "1"], "ulysses"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--lengths", "/no/such/file"], "--lengths"),
    (["--link-rate", "fast"], "--link-rate"),
    (["--dp", "1", "--cp", "1", "--tp", "1"], "at least 2 ranks"),
    (["--configs", "torch,torch_compile", "--warmup", "0"], "--warmup 0: torch_compile"),
])
def test_bad_arguments_stop_with_one_line_before_any_rank(argv, needle, capsys, monkeypatch):
    import flashpar.bench.launch as launch

    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launch, "run_workers", no_ranks)
    base = [a for a in TINY if a not in ("--link-rate", "none")]
    assert cli.main(["bench", "train", *base, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flashpar bench train: ") and len(err.splitlines()) == 1, err
    assert needle in err, err


def test_a_ulysses_mesh_is_accepted_and_tp_with_ulysses_refused():
    assert bench_train.check_arguments(_config(ulysses=2, cp=1, tp=1)) is None
    problem = bench_train.check_arguments(_config(ulysses=2, cp=1, tp=2))
    assert problem is not None and "--ulysses" in problem and "--tp" in problem, problem


def test_packed_documents_are_multiples_of_two_cp_and_fill_the_sequence():
    config = _config(dp=2, cp=2, tp=1, seq_len=256)
    packs = packed_docs(config)
    assert len(packs) == 2
    for lens in packs:
        assert sum(lens) == 256 and all(n % 4 == 0 and n > 0 for n in lens)
    seqs = bench_train.sequences(config)
    for (tokens, labels, lens), docs in zip(seqs, packs, strict=True):
        assert tokens.shape == labels.shape == (256,) and lens == docs
        ends = [sum(lens[: i + 1]) - 1 for i in range(len(lens))]
        assert all(int(labels[e]) == -100 for e in ends)
        assert int((labels != -100).sum()) == 256 - len(lens)


# ---- the torch peer ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_torch_peer_matches_the_single_process_llama_in_float64(n):
    """Loss and every gradient of the peer (DTensor TP-SP + loss parallel, FSDP2 over dp x cp, per-document
    head-tail cp with all-gathered K/V) against flashpar's single-process Llama on the same weights and
    sequences.  Both in float64: the same sums in another order and split over ranks agree to ~1e-15
    relative; 1e-10 leaves room for the reductions' order and fails on any missing or doubled sum."""
    for mesh, r in spawned(n)["peer"][0].items():
        assert math.isclose(r["loss"], r["ref"], rel_tol=1e-10), (mesh, r)
        assert r["grad_err"] < 1e-10, (mesh, r)


def test_compiled_peer_at_tp2_matches_the_eager_peer():
    """The torch_compile peer (every block compiled whole after TP-SP, ``fullgraph=True``) at tp 2 against the eager
    peer on the same weights and sequences, fp32, two layers, two AdamW steps: the same losses and first-step
    gradients, every parameter's (the embedding's included: a compiled first block that dropped its input's
    gradient would leave it zero or fail).  Inductor fuses the elementwise chains (rope, RMSNorm, SwiGLU, residual
    adds) and may sum RMSNorm's squares in another order, a few fp32 ulps (~1e-7 relative) per value; observed
    differences are <= 1e-7 relative on the losses and <= 5e-7 of the largest gradient, so 1e-5 leaves 20x room
    and still fails on any missing or doubled term.  One compiled graph serves both blocks, nothing recompiles
    after the first step, and torch's compile-time metric counted it."""
    for r in spawned(2)["compiled"]:
        for eager, compiled in zip(r["eager"], r["compiled"], strict=True):
            assert math.isclose(compiled, eager, rel_tol=1e-5), r
        assert r["grad_err"] < 1e-5, r
        assert r["compile_s"] > 0 and r["compiles_first_step"] == 2 and r["compiles_later"] == 0, r


@pytest.mark.parametrize("mesh", SOLO_MESHES)
def test_no_comm_skips_every_transfer_of_every_configuration(mesh):
    """Rank 0 alone steps each configuration inside ``no_comm()`` (TP-SP, context parallelism, ZeRO-3 / FSDP2):
    a transfer that escaped the fakes would wait for a peer that never calls it.  Leaving the block restores
    the real calls."""
    solo = spawned(2)[f"solo{mesh}"]
    assert solo[0]["done"] == list(bench_train.DEFAULT_CONFIGS)
    assert all(r["restored"] for r in solo)


def test_no_comm_skips_the_gathered_vocabulary_weights_too():
    """The same with more tokens than vocabulary rows (``flashpar.models.vocab.gathers_weight``): the weights'
    all-gathers and their reduce-scatters in backward are faked as well."""
    from flashpar.models.vocab import gathers_weight

    assert gathers_weight(256, 512, 2)
    solo = spawned(2)["solo-vocab"]
    assert solo[0]["done"] == list(bench_train.DEFAULT_CONFIGS)
    assert all(r["restored"] for r in solo)


# ---- smoke runs -------------------------------------------------------------------------------


def _bench(tmp_path, *argv) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "flashpar.cli", "bench", "train", *TINY, *argv, "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


# tp 2 here; tests/test_readme_commands.py runs a Ulysses mesh (the torch peer on cp 2) with the JSON checked
@pytest.mark.parametrize("mesh", [("1", "1", "2")])
def test_smoke_run_reports_every_configuration_with_agreeing_first_losses(tmp_path, mesh):
    dp, cp, tp = mesh
    proc, report = _bench(tmp_path, "--dp", dp, "--cp", cp, "--tp", tp)
    assert set(report) == {"setup", "configs"}
    assert report["setup"]["world_size"] == 2 and report["setup"]["losses_agree"] is True
    rows = report["configs"]
    assert [r["name"] for r in rows] == list(bench_train.DEFAULT_CONFIGS)
    keys = {"name", "tokens_per_s", "step_ms", "exposed_ms", "mfu", "peak_mem_mb", "loss_step1"}
    for r in rows:
        assert keys <= set(r), r
        assert all(isinstance(r[k], float) and math.isfinite(r[k]) for k in keys - {"name"}), r
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["mfu"] > 0
        # the ranks' CPU per step, measured by the processes (every thread): a step computes, so both are
        # positive; the communication's share may read either way on loopback, but it is a finite number
        assert r["cpu_ms"] > 0 and r["no_comm_cpu_ms"] > 0 and math.isfinite(r["comm_cpu_ms"]), r
    # fp32 on every path, the same sums in other orders: the first-step losses agree to a few ulps of the
    # ~5.5 loss summed over a few hundred targets (1e-5 relative is ~100 fp32 ulps)
    losses = [r["loss_step1"] for r in rows]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0]), losses
    # the breakdown: every part measured on every rank, they add up to the measured step's wall time (cut from the
    # same clock reads: equal up to float rounding of a few thousand additions, far under 1e-9 relative), and the
    # parts every step has are there: attention both ways, the GEMMs, the loss, the optimizer, the communication
    # (tp 2 gathers and reduce-scatters)
    for r in rows:
        b = r["breakdown_ms"]
        assert set(b) == {"attention_fwd", "attention_bwd", "linear", "elementwise", "loss", "optimizer",
                          "exposed_comm", "other"}, b
        assert len(r["breakdown_ms_per_rank"]) == 2 and all(v >= 0 for v in b.values()), r
        assert sum(b.values()) == pytest.approx(r["breakdown_wall_ms"], rel=1e-9), r
        assert r["breakdown_step_ms"] > 0, r  # the plain step it is compared with
        assert all(b[p] > 0 for p in ("attention_fwd", "attention_bwd", "linear", "loss", "optimizer",
                                      "exposed_comm")), (r["name"], b)
    assert "where the step goes" in proc.stdout
    assert "first-step losses agree" in proc.stdout
    for name in bench_train.DEFAULT_CONFIGS:
        assert any(line.startswith(name) for line in proc.stdout.splitlines()), proc.stdout


def test_flashpar_compile_trains_as_flashpar_and_its_regions_count_as_elementwise(tmp_path):
    """``flashpar_compile`` (the trainer's ``--compile``) beside ``flashpar`` at tp 2: the same first-step loss within
    fp32 rounding (1e-5 relative; inductor's fused regions reorder a few roundings), its compilation reported
    before the timed steps and none in them, a breakdown whose parts add up to its step with the compiled regions
    counted as elementwise, and the ratio line."""
    proc, report = _bench(tmp_path, "--dp", "1", "--cp", "1", "--tp", "2", "--configs", "flashpar,flashpar_compile")
    rows = {r["name"]: r for r in report["configs"]}
    assert rows["flashpar_compile"]["loss_step1"] == pytest.approx(rows["flashpar"]["loss_step1"], rel=1e-5)
    assert rows["flashpar"]["compile_s"] == 0 and rows["flashpar_compile"]["compile_s"] > 0, rows
    assert rows["flashpar_compile"]["recompiles"] == 0, rows
    b = rows["flashpar_compile"]["breakdown_ms"]
    assert b["elementwise"] > 0 and b["linear"] > 0, b
    assert sum(b.values()) == pytest.approx(rows["flashpar_compile"]["breakdown_wall_ms"], rel=1e-9)
    assert "tokens/s ratios: flashpar_compile / flashpar" in proc.stdout, proc.stdout


def test_report_sums_the_ranks_cpu_per_step_and_spreads_the_extra_over_the_shared_cores(monkeypatch):
    """``cpu_ms``: per step the ranks' CPU summed, then the median over steps; ``comm_cpu_ms``: the extra CPU
    with communication over the cores the ranks' threads share (min(cores, ranks x threads))."""
    config = {**_config(dp=1, cp=1, tp=2), "configs": ["flashpar"], "link_rate": "loopback"}
    seqs = bench_train.sequences(config)
    walls = {"step": [0.5, 0.6, 0.7], "no_comm": [0.4, 0.4, 0.4]}
    cpus = [{"step": [0.9, 1.0, 3.0], "no_comm": [0.7, 0.8, 0.9]},  # rank 0
            {"step": [1.1, 1.2, 0.1], "no_comm": [0.8, 0.8, 0.8]}]  # rank 1
    gathered = [{"samples": {("flashpar", k): walls[k] for k in walls}
                 | {("flashpar", k + "_cpu"): c[k] for k in c}, "mem": {"flashpar": 1.0}} for c in cpus]
    for cores, shared in ((1, 1), (8, 2)):  # 2 ranks of 1 thread: they share min(cores, 2) cores
        monkeypatch.setattr(links, "host_cores", lambda cores=cores: cores)
        row = bench_train.make_report(config, gathered, [5.0], 1e9, seqs)["configs"][0]
        # step sums over the ranks: 2.0, 2.2, 3.1 -> median 2.2; no-comm 1.5, 1.6, 1.7 -> 1.6
        assert row["cpu_ms"] == pytest.approx(2200) and row["no_comm_cpu_ms"] == pytest.approx(1600)
        assert row["comm_cpu_ms"] == pytest.approx(600 / shared)
        assert row["step_ms"] == pytest.approx(600) and row["exposed_ms"] == pytest.approx(200)


def test_report_gives_each_configuration_its_slowest_ranks_compile_time_and_names_timed_compilations():
    """``compile_s``: the largest over the ranks (they compile at once, the slowest holds the others at the next
    barrier); ``recompiles``: the most compilations a rank did in its timed steps, named in the printed report when
    any.  A configuration without a breakdown (a compiled one) has no breakdown figures; the others keep theirs."""
    config = {**_config(dp=1, cp=1, tp=2), "configs": ["torch", "torch_compile"], "link_rate": "loopback"}
    seqs = bench_train.sequences(config)
    parts = {"attention_fwd": 1.0, "attention_bwd": 1.0, "linear": 1.0, "elementwise": 1.0, "loss": 1.0,
             "optimizer": 1.0, "exposed_comm": 1.0, "other": 1.0, "wall_ms": 8.0, "plain_ms": 9.0}
    gathered = [{"samples": {(name, k): [0.5] for name in config["configs"]
                             for k in ("step", "no_comm", "step_cpu", "no_comm_cpu")},
                 "mem": {"torch": 1.0, "torch_compile": 1.0}, "parts": {"torch": parts},
                 "compile_s": {"torch": 0.0, "torch_compile": seconds},
                 "recompiles": {"torch": 0, "torch_compile": late}} for seconds, late in ((12.0, 0), (14.5, 1))]
    report = bench_train.make_report(config, gathered, [5.0, 5.0], 1e9, seqs)
    rows = {r["name"]: r for r in report["configs"]}
    assert (rows["torch"]["compile_s"], rows["torch"]["recompiles"]) == (0.0, 0)
    assert (rows["torch_compile"]["compile_s"], rows["torch_compile"]["recompiles"]) == (14.5, 1)
    assert "breakdown_ms" in rows["torch"] and "breakdown_ms" not in rows["torch_compile"]
    text = bench_train.format_report(report)
    assert "compile s" in text
    assert "compiled during timed steps (their step times include it): torch_compile (1)" in text

"""The h100-96gb preset against torchtitan's published H100 runs (``flashpar.sim.anchors``, ``flashpar simulate
anchors``) and ``flashpar simulate table``: deterministic pure-Python computations."""

from __future__ import annotations

import json

import pytest

from flashpar import cli
from flashpar.cost import preset
from flashpar.cost.presets import H100_96GB_CLOCK
from flashpar.sim import anchors
from flashpar.sim.memory import GPU_MEMORY_GB

BY_NAME = {a.name: a for a in anchors.ANCHORS}


def test_the_preset_is_the_datasheet_and_one_fitted_clock():
    hw = preset("h100-96gb")
    assert (hw.flops, hw.memory_bytes_per_s, hw.link_bytes_per_s) == (989e12, 2.4e12, 450e9)
    assert hw.gemm_eff == pytest.approx(0.7 * H100_96GB_CLOCK) and hw.attn_peak == pytest.approx(0.6 * H100_96GB_CLOCK)
    assert (hw.gemm_overhead_s, hw.link_latency_s) == (preset("h100-nvlink").gemm_overhead_s, 10e-6)
    assert GPU_MEMORY_GB["h100-96gb"] == 96.0


def test_the_fit_reproduces_its_run_and_the_stored_clock():
    """Table 1's FSDP run (5,762 tokens/s/GPU) within 2% at the preset's clock; the published figure lies
    between the simulations 1% below and above it (tokens/s grows with the clock), so the stored clock is the
    fit's root, and the bisection finds it again."""
    fit = BY_NAME["8b-fsdp-8"]
    assert fit.role == "fit" and [a.role for a in anchors.ANCHORS].count("fit") == 1
    sim = anchors.simulate(fit)["tokens_per_s_per_gpu"]
    assert abs(sim / fit.published - 1) <= 0.02
    lo, hi = (anchors.simulate(fit, H100_96GB_CLOCK * f)["tokens_per_s_per_gpu"] for f in (0.99, 1.01))
    assert lo < fit.published < hi
    assert anchors.fit() == pytest.approx(H100_96GB_CLOCK, abs=6e-4)


def test_the_checked_runs_are_within_15_percent():
    """Table 3 (128 GPUs), the 70B FSDP 32 x TP 8 runs with DTensor TP and async TP, and Table 1 / 3 with
    torch.compile: each within 15% of the published tokens/s/GPU.  The 8B FSDP 8 x TP 8 runs of the async-TP
    file are simulated 22-24% faster than published (the report says why): only their async / vanilla
    speedup is checked (1.10 published)."""
    rows = {r["anchor"]: r for r in anchors.rows()}
    for name in ("8b-fsdp-128", "70b-tp", "70b-async-tp", "8b-fsdp-8-compile", "8b-fsdp-128-compile"):
        assert rows[name]["within"] == "yes" and abs(rows[name]["error"]) <= 0.15, rows[name]
    speedup = rows["8b-async-tp"]["simulated"] / rows["8b-tp"]["simulated"]
    assert abs(speedup / (4809.4 / 4378) - 1) <= 0.15
    seventy = rows["70b-async-tp"]["simulated"] / rows["70b-tp"]["simulated"]
    assert seventy > 1.0 and abs(seventy / (652.4 / 597.3) - 1) <= 0.05
    for a in anchors.ANCHORS:  # every anchor names its published line
        assert a.source.startswith("pytorch/torchtitan benchmarks/") and ".md:" in a.source


def test_anchors_command_prints_every_run(tmp_path, capsys):
    out = tmp_path / "anchors.json"
    assert cli.main(["simulate", "anchors", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("simulated, h100-96gb preset")
    for a in anchors.ANCHORS:
        assert a.name in text
    report = json.loads(out.read_text())
    assert report["setup"]["simulated"] and len(report["rows"]) == len(anchors.ANCHORS)


def test_table_prints_one_markdown_row_per_cell(tmp_path, capsys):
    """A small model on 8 GPUs at two lengths: each configuration's fastest layout, the ratio, the fits."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
                               "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
                               "vocab_size": 1024, "max_position_embeddings": 8192}))
    out = tmp_path / "table.json"
    code = cli.main(["simulate", "table", "--models", str(cfg), "--gpus", "8", "--seqs", "2K,4K", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert text.startswith("simulated, h100-96gb preset")
    lines = [ln for ln in text.splitlines() if ln.startswith(f"| {cfg}")]
    assert len(lines) == 2 and "2K" in lines[0] and "4K" in lines[1]
    rows = json.loads(out.read_text())["rows"]
    for r, line in zip(rows, lines, strict=True):
        best = max((r[f"{c}_best"] for c in ("torch", "torch_async_tp")), key=lambda x: x["tokens_per_s"])
        assert f"| {r['flashpar_best']['tokens_per_s'] / best['tokens_per_s']:.2f} |" in line
        assert line.endswith(f"{r['fits']['flashpar']} / {r['fits']['torch']} / {r['fits']['torch_async_tp']} of "
                             f"{r['layouts']} |")


@pytest.mark.parametrize(("argv", "needle"), [
    (["--gpus", "x"], "--gpus"),
    (["--configs", "torch"], "--configs"),
    (["--seqs", "0"], "--seqs"),
])
def test_table_bad_arguments_stop_with_one_line(argv, needle, capsys):
    assert cli.main(["simulate", "table", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("flashpar simulate table: ") and needle in err, err

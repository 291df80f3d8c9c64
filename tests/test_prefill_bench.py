"""``flashpar bench prefill`` (a tiny run on loopback: the report's fields, the first logits agreeing across the
three configurations) and ``flashpar simulate prefill`` (its estimates beside Meta's published figures)."""

from __future__ import annotations

import json

import pytest

from flashpar.cli import main
from flashpar.sim.prefill import PUBLISHED, rows_of


@pytest.fixture(scope="module")
def simulated():
    return rows_of(["llama3-70b", "llama3-405b"], [128], [128 * 1024, 1 << 20], "h100-ib", "wlbllm")


def test_simulated_prefill_is_on_the_published_scale_and_flashcp_never_loses(simulated):
    """The 405B estimates within 2x of Meta's published times either way (the cost model's H100 figures, not a
    fit to them); for every (model, tokens, workload) flashcp's time to first token is at most per_doc's and it
    moves less K/V; a longer prefill takes longer."""
    by = {(r["model"], r["tokens"], r["workload"], r["strategy"]): r for r in simulated}
    for (model, _, tokens), seconds in PUBLISHED.items():
        r = by[(model, tokens, "one", "flashcp")]
        assert r["published_s"] == seconds and 0.5 < r["ttft_s"] / seconds < 2.0, r
    for (model, tokens, workload, strategy), r in by.items():
        if strategy == "flashcp":
            base = by[(model, tokens, workload, "per_doc")]
            assert r["ttft_s"] <= base["ttft_s"] * (1 + 1e-9) and r["kv_recv_gb"] < base["kv_recv_gb"], (r, base)
            assert by[(model, 1 << 20, workload, strategy)]["ttft_s"] >= r["ttft_s"]
    assert any(r["workload"] == "mixed" and r["prompts"] > 1 for r in simulated)


def test_simulate_prefill_command_and_a_bad_argument(capsys, tmp_path):
    out = tmp_path / "sim.json"
    assert main(["simulate", "prefill", "--models", "llama3-70b", "--tokens", "128K", "--json", str(out)]) == 0
    assert "llama3-70b" in capsys.readouterr().out and len(json.loads(out.read_text())["rows"]) == 4
    assert main(["simulate", "prefill", "--tokens", "12Q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashpar simulate prefill:") and len(err.strip().splitlines()) == 1


def test_bench_prefill_reports_every_configuration_and_their_logits_agree(tmp_path, capfd):
    """A tiny run (4 ranks, tp 2 x cp 2, loopback, one round): the JSON has every field of the report for flashpar,
    baseline and torch; the first logits agree (the command exits 1 otherwise); torch has no decode figure;
    flashpar's K/V per rank is within 1.1 x (the batch's K/V / cp) plus the plan's token slack."""
    out = tmp_path / "bench.json"
    code = main(["bench", "prefill", "--tokens", "256", "--lengths", "96,40,24,16,8,48,24", "--scale", "1",
                 "--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "64",
                 "--decode-steps", "2", "--rounds", "1", "--warmup", "0", "--link-rate", "none", "--json", str(out)])
    text = capfd.readouterr()
    assert code == 0, text.err
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["configs"]}
    assert set(rows) == {"flashpar", "baseline", "torch"} and report["setup"]["logits_agree"]
    for r in rows.values():
        assert {"ttft_ms", "prefill_tokens_per_s", "decode_tokens_per_s", "kv_bytes", "peak_mem_mb"} <= set(r)
        assert r["ttft_ms"] > 0 and r["kv_bytes"] > 0
    assert rows["torch"]["decode_tokens_per_s"] is None and rows["flashpar"]["decode_tokens_per_s"] > 0
    # the breakdown of one more time to first token: every part, adding up to the measured run (each interval of it
    # counted once, for one part: float rounding only); the regions where each configuration has them (the torch
    # peer plans nothing in the timed work: its batch's layout is built with the runner)
    from flashpar.bench.prefill import PARTS

    for name, r in rows.items():
        b = r["breakdown_ms"]
        assert set(PARTS) <= set(b) and set(b) == set(r["breakdown_cpu_ms"]), (name, b)
        assert sum(b.values()) == pytest.approx(r["breakdown_wall_ms"], rel=1e-9)
        assert b["logits"] > 0 and b["linear"] > 0 and b["attention_fwd"] > 0, (name, b)
        assert (b["planning"] > 0 and b["setup"] > 0) == (name != "torch"), (name, b)
    assert "where the time to first token goes" in text.out
    # K/V of a token on one rank: 2 (K, V) x 2 layers x 1 kv head (tp 2) x head dim 8 x 4 bytes; the batch's
    # 256 prompt tokens + 7 prompts x 2 decode steps, over cp 2
    per_token = 2 * 2 * 1 * 8 * 4
    batch = (256 + 7 * 2) * per_token
    assert rows["flashpar"]["kv_bytes"] <= 1.1 * batch / 2 + 0.05 * 256 * per_token


def test_bench_prefill_bad_argument_is_one_line(capsys):
    assert main(["bench", "prefill", "--tokens", "250"]) == 2
    err = capsys.readouterr().err
    assert "--tokens 250 must be a multiple" in err and len(err.strip().splitlines()) == 1


def test_bench_prefill_refuses_a_compiled_configuration_without_warm_up(capsys):
    assert main(["bench", "prefill", "--configs", "torch,torch_compile", "--warmup", "0"]) == 2
    err = capsys.readouterr().err
    assert "--warmup 0: torch_compile" in err and len(err.strip().splitlines()) == 1


def test_bench_prefill_compiled_configurations_at_tp2_agree_and_report_their_compile_time(tmp_path, capfd):
    """flashpar with its regions compiled and the torch peer with its blocks compiled (2 ranks, tp 2, one layer):
    their first logits agree with the eager ones' (the command exits 1 otherwise), each reports the seconds
    torch.compile spent before its timed runs and no compilation in them; the eager ones compile nothing; the
    compiled peer has no breakdown (its whole-block graphs are invisible to the breakdown's dispatch mode),
    flashpar's compiled regions count as elementwise."""
    out = tmp_path / "bench.json"
    code = main(["bench", "prefill", "--tokens", "128", "--lengths", "48,40,24,16", "--scale", "1", "--hidden", "32",
                 "--layers", "1", "--heads", "4", "--kv-heads", "2", "--ffn", "64", "--decode-steps", "1",
                 "--rounds", "1", "--warmup", "1", "--tp", "2", "--cp", "1", "--link-rate", "none",
                 "--configs", "flashpar,flashpar_compile,torch,torch_compile", "--json", str(out)])
    text = capfd.readouterr()
    assert code == 0, text.err[-3000:]
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["configs"]}
    assert report["setup"]["logits_agree"], report["setup"]
    for eager, compiled in (("flashpar", "flashpar_compile"), ("torch", "torch_compile")):
        assert rows[eager]["compile_s"] == 0 and rows[compiled]["compile_s"] > 0, rows
        assert rows[eager]["recompiles"] == 0 and rows[compiled]["recompiles"] == 0, rows
    assert "breakdown_ms" in rows["torch"] and "breakdown_ms" not in rows["torch_compile"]
    assert rows["flashpar_compile"]["breakdown_ms"]["elementwise"] > 0, rows["flashpar_compile"]
    assert "compile s" in text.out and "compiled during timed" not in text.out

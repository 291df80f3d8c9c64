"""`flashpar bench cp` end to end on loopback (a smoke run: numbers are not checked, only their shape)."""

from __future__ import annotations

import json

import pytest

from flashpar.cli import main
from flashpar.cp import STRATEGIES
from flashpar.cp.lengths import resolve_lengths


def test_bench_cp_runs_every_strategy_and_reports_measured_and_predicted(tmp_path, capsys):
    out = tmp_path / "cp.json"
    rc = main(["bench", "cp", "--nproc", "2", "--link-rate", "none", "--tokens", "1024", "--packs", "1",
               "--rounds", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--json", str(out),
               "--timeout", "300"])
    assert rc == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert list(rows) == list(STRATEGIES)
    for row in rows.values():
        assert row["overlapped"] > 0 and row["compute"] > 0 and row["pred_step"] > 0
    # bytes are measured: sharding-aware plans never send more than the all-gather of per_doc
    assert rows["flashcp"]["bytes"] <= rows["per_doc_aware"]["bytes"] <= rows["per_doc"]["bytes"]
    assert rows["per_doc"]["bytes"] > 0
    text = capsys.readouterr().out
    assert "x headtail" in text and "pred ms" in text and "flashcp" in text


@pytest.mark.parametrize(("argv", "words"), [
    (["--lengths", "nope"], "--lengths: unknown lengths 'nope': expected a shipped name (wlbllm, prolong"),
    (["--lengths", "sotu", "--tokens", "100000000"], "makes no full pack of 100000000 tokens"),
    (["--strategies", "flashcp,ring"], "--strategies: unknown ['ring']"),
    (["--nproc", "1"], "--nproc must be >= 2, got 1"),
    (["--scale", "0"], "--scale must be >= 1, got 0"),
    (["--heads", "3", "--kv-heads", "2"], "--heads 3 is not a multiple of --kv-heads 2"),
])
def test_bench_cp_bad_arguments_are_one_line_before_any_rank_starts(argv, words, capsys, monkeypatch):
    import flashpar.bench.netlink as netlink

    def no_launch(*a, **k):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(netlink, "launch_on_links", no_launch)
    assert main(["bench", "cp", "--link-rate", "none", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flashpar bench cp: ") and words in err and len(err.splitlines()) == 1, err


def test_bench_cp_takes_a_path_as_lengths(tmp_path):
    from flashpar.sim.bench_runs import cp_packs

    path = tmp_path / "wlbllm.lengths"
    path.write_text("\n".join(map(str, resolve_lengths("wlbllm").values[:500])))
    config = {"lengths": str(path), "tokens": 4096, "packs": 2, "scale": 16}
    assert cp_packs(config) == cp_packs({**config, "lengths": "wlbllm"})  # the same list by path or by name

"""``flashpar bench cp --window W``: every strategy runs windowed attention at the scaled window and reports the
K/V it sent beside what the same plans send without the window."""

from __future__ import annotations

import json

from flashpar.cli import main


def test_bench_cp_window_reports_kv_with_and_without_the_window(tmp_path, capsys):
    out = tmp_path / "cp.json"
    rc = main(["bench", "cp", "--nproc", "2", "--link-rate", "none", "--tokens", "1024", "--packs", "1",
               "--rounds", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--window", "2048",
               "--strategies", "flashcp,headtail", "--json", str(out), "--timeout", "300"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "window 128 (--window 2048 / 16)" in text and "without it (the same plans)" in text
    rows = json.loads(out.read_text())["rows"]
    for s, row in rows.items():
        assert 0 < row["bytes"] <= row["plan_bytes_no_window"], s
    assert rows["headtail"]["bytes"] < rows["headtail"]["plan_bytes_no_window"]  # a ring sends every block


def test_bench_cp_bad_window_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr("flashpar.bench.launch.run_workers", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    assert main(["bench", "cp", "--link-rate", "none", "--window", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "flashpar bench cp: --window must be >= 1, got 0"

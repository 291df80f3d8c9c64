"""The soak run's watch (``flashpar.train.soak``): what it samples, and a verdict that fails on each kind of leak.

The 2,000-step run itself is ``make soak`` (minutes; not in CI); here the sampler runs in this process and the
verdict on made-up sample series, so each guarantee is shown to fail when it is broken."""

from __future__ import annotations

import json

import pytest

from flashpar.train import soak


def _series(rss, **counts):
    base = {"threads": 30, "fds": 60, "groups": 9, "children": 1}
    out = []
    for i, r in enumerate(rss):
        s = {"step": 100 * i + 1, "rss_kb": r, **base}
        for k, v in counts.items():
            s[k] = v[i]
        out.append(s)
    return out


def test_sample_reads_this_process():
    s = soak.sample(7)
    assert s["step"] == 7 and s["rss_kb"] > 10_000 and s["threads"] >= 1 and s["fds"] >= 3
    assert set(s) == {"step", "rss_kb", "threads", "fds", "groups", "children"}


def test_record_writes_step_one_and_every_k(tmp_path):
    for step in range(1, 12):
        soak.record(str(tmp_path), 5, step)
    lines = (tmp_path / "rank0.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 5, 10]


def test_verdict_passes_a_flat_run_and_ignores_the_warm_up():
    v = soak.verdict(_series([100_000, 300_000, 301_000, 302_000]), warmup=100)  # warm-up growth is not a leak
    assert v["ok"] and v["from_step"] == 101 and v["rss_growth"] == pytest.approx(302 / 300 - 1)


@pytest.mark.parametrize("rss, counts, why", [
    ([300_000, 300_000, 316_000], {}, "resident set grew 5.3%"),
    ([300_000] * 3, {"threads": [30, 30, 31]}, "threads 30 -> 31"),
    ([300_000] * 3, {"fds": [60, 64, 70]}, "fds 60 -> 70"),
    ([300_000] * 3, {"groups": [9, 9, 10]}, "groups 9 -> 10"),
    ([300_000] * 3, {"children": [1, 1, 2]}, "children 1 -> 2"),
])
def test_verdict_fails_on_each_leak(rss, counts, why):
    v = soak.verdict(_series(rss, **counts), warmup=1)
    assert not v["ok"] and why in v["why"]


def test_verdict_needs_samples_after_the_warm_up():
    assert not soak.verdict([], 1)["ok"]
    assert "fewer than 2 samples" in soak.verdict(_series([1, 2]), warmup=150)["why"]


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--steps", "300", "--warmup", "250", "--every", "50"], "fewer than 2 samples after --warmup 250"),
    # a bad training flag: train's own line, before any rank
    (["--steps", "2000", "--nproc", "4", "--cp", "3"], "does not match"),
])
def test_bad_flags_one_line(argv, message, capsys, tmp_path):
    assert soak.main([*argv, "--out", str(tmp_path / "soak")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1

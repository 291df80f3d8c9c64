"""``flashpar.ranks``: rank processes forked from a preloaded server see the launcher as it is when they start."""

from __future__ import annotations

import pytest

from dist_harness import run_ranks
from flashpar import ranks
from ranks_workers import report


def test_a_rank_takes_the_environment_and_output_of_the_moment_it_starts(monkeypatch, capfd):
    """The server is started by the first launch (perhaps by an earlier test, with another environment and
    another capture): a rank started later still sees the variable set now and writes to this test's
    capture, on stdout and on stderr."""
    run_ranks(1, report)  # make sure the server is running before the variable exists
    capfd.readouterr()
    for value in ("first", "second"):
        monkeypatch.setenv("FLASHPAR_RANKS_TEST", value)
        out = run_ranks(2, report)
        assert [o["var"] for o in out] == [value, value]
        captured = capfd.readouterr()
        assert "rank 0 stdout" in captured.out and "rank 1 stdout" in captured.out, captured
        assert "rank 0 stderr" in captured.err and "rank 1 stderr" in captured.err, captured


@pytest.mark.skipif(ranks.start_method() != "forkserver", reason="no forkserver on this platform")
def test_ranks_fork_from_a_server_that_imported_the_trainer():
    """The ranks' parent is the server, not this process, and what it preloaded is there without an import."""
    import os

    out = run_ranks(2, report)
    assert all(o["parent"] != os.getpid() and o["preloaded"] for o in out), out

"""The progress bar's ETA leaves out the first steps (they start workers and warm caches: the first of a CPU run
takes many times a later one) and takes the median of the rest."""

from __future__ import annotations

from flashpar.train.loop import WARM_STEPS, eta


def test_the_eta_waits_for_timed_steps_and_takes_their_median():
    assert WARM_STEPS == 2
    assert eta([], 400) == "warming up"
    assert eta([23.0, 7.3], 398) == "warming up"  # step 1 at 23 s would have said 2:32:52
    assert eta([23.0, 7.3, 0.3], 397) == "0:01:59"  # 397 x 0.3 s
    assert eta([23.0, 7.3, 0.3, 0.5, 0.4, 9.0], 100) == "0:00:50"  # the upper median of 0.3, 0.4, 0.5, 9.0: 0.5
    assert eta([5.0, 5.0, 2.0], 3600) == "2:00:00"
    assert eta([5.0, 5.0, 2.0], 0) == "0:00:00"

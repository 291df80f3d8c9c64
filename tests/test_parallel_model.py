"""The parallel Llama on a (dp, cp, tp) mesh against the single-process model: loss and every gradient."""

from __future__ import annotations

import pytest

from dist_harness import run_ranks
from train_workers import check_mesh


@pytest.mark.parametrize("shape, dp_mode, tie", [((1, 2, 2), "zero3", True), ((2, 2, 1), "zero3", True),
                                                 ((2, 1, 2), "zero3", True), ((4, 1, 1), "zero3", True),
                                                 ((1, 4, 1), "zero3", True), ((2, 2, 1), "replicate", True),
                                                 ((2, 1, 2), "replicate", False), ((1, 2, 2), "zero3", False)])
def test_parallel_model_matches_single_process(shape, dp_mode, tie):
    per_rank = run_ranks(4, check_mesh, shape, dp_mode, tie)
    bad = {r: errs for r, (errs, _) in enumerate(per_rank) if errs}
    # loss, 9 tensors per block, embedding, final norm (and the head when untied)
    assert per_rank[0][1] == 1 + 9 * 2 + 2 + (not tie) and not bad, bad

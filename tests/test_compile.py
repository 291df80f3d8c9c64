"""``ParallelOptions.compile`` (``flashpar train --compile``): the regions between the communicating ops compiled by
torch.compile, checked against the float64 single-process step on every mesh kind at world sizes 1 to 4; the
graphs a model compiles, counted; a run whose plans change every step compiles nothing after start-up."""

from __future__ import annotations

import pytest

from compile_workers import compiled_against_float64, graphs_of_warm_up, steady_steps
from dist_harness import SpawnCache

# (dp, cp, ulysses, tp), dp mode, model (compile_workers.COMPILE_MODELS), ParallelOptions settings -> world size:
# tp-sp, cp, ulysses and ZeRO-3 over dp at each size (ZeRO-3 over the shard group wherever it has 2 ranks or more);
# bf16 and a model with its biases and qk-norm (each a graph set of its own) at 1, where one process compiles it;
# activation checkpointing at 2 (the same graphs as the step without it)
CASES = {
    1: [((1, 1, 1, 1), "zero3", "base", ()), ((1, 1, 1, 1), "zero3", "base", (("dtype", "bf16"),)),
        ((1, 1, 1, 1), "zero3", "biased", ())],
    2: [((1, 1, 1, 2), "zero3", "base", ()), ((1, 2, 1, 1), "zero3", "base", ()), ((1, 1, 2, 1), "zero3", "base", ()),
        ((2, 1, 1, 1), "zero3", "base", ()), ((1, 2, 1, 1), "zero3", "base", (("checkpoint_activations", True),))],
    3: [((1, 1, 1, 3), "zero3", "heads6-vocab12", ()),
        ((1, 3, 1, 1), "zero3", "heads6-vocab12", (("zero_schedule", "fused"),)),
        ((1, 1, 3, 1), "zero3", "heads6-vocab12", ()), ((3, 1, 1, 1), "zero3", "heads6-vocab12", ())],
    4: [((1, 2, 1, 2), "zero3", "base", ()), ((2, 1, 2, 1), "zero3", "base", ()), ((1, 4, 1, 1), "zero3", "base", ())],
}
IDS = [(n, case) for n, cases in CASES.items() for case in cases]
# fp32: the mesh reorders sums (eager's error against float64 is <= 1e-6 here) and inductor fuses each region's
# elementwise ops, keeping intermediates in registers instead of rounding them to fp32 between kernels, and sums
# the norm's squares in its own order: a few fp32 roundings more per element (measured <= 1e-6).  1e-5 leaves
# 10x; a region computing the wrong thing (a missing bias, rope on the wrong half) is O(1).
FP32_TOL = 1e-5
BF16_TOL = 3e-2  # flashpar.models.precision.CHECK_TOL["bf16"]: the compiled step must stay within eager's bound
STEADY_STEPS = 20


def _calls(n: int) -> list[tuple]:
    first = {1: [("graphs", graphs_of_warm_up, ["base", "biased"])],  # first: nothing compiled in the ranks yet
             2: [("steady", steady_steps, (1, 2, 1, 1), STEADY_STEPS)]}
    return [*first.get(n, []), ("exact", compiled_against_float64, CASES[n])]


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(_calls, timeout=900.0)  # one spawn per world size; the first compiles take tens of seconds


@pytest.mark.parametrize("n, case", IDS, ids=[f"{n}-{c[0]}-{c[2]}-{dict(c[3])}" for n, c in IDS])
def test_compiled_step_matches_float64_single_process(spawned, n, case):
    """The compiled model's loss and every gradient (tp shards gathered) against the float64 single-process step,
    within ``FP32_TOL`` (``BF16_TOL`` in bf16); and eager's too, the same check, so that both are held to it."""
    eager, compiled = spawned(n)["exact"][0][CASES[n].index(case)]
    tol = BF16_TOL if dict(case[3]).get("dtype") == "bf16" else FP32_TOL
    assert set(compiled) == set(eager) and len(compiled) >= 12, sorted(compiled)
    bad = {k: (eager[k], v) for k, v in compiled.items() if not v <= tol or not eager[k] <= tol}
    assert not bad, bad


def test_a_model_compiles_five_graphs_once(spawned):
    """``warm_up`` compiles the six regions (norm, heads, add_norm, swiglu, add, the loss's loss_sums) for training
    and the block's five for prefill's forward-only calls (prefill computes no loss), and nothing when run again;
    Qwen3 with attention biases then compiles two more of each (heads with its biases and qk-norm, add_norm with
    the o bias; its norm, swiglu, add and loss are the first model's).  A region that broke into several graphs,
    or a communicating op traced into one, would change the counts."""
    got = spawned(1)["graphs"][0]
    assert got["base"] == (6, 5, 0) and got["biased"] == (2, 2, 0), got
    assert got["explain"] == (1, 0), got


def test_twenty_steps_with_changing_plans_compile_nothing_more(spawned):
    """On cp 2 (ZeRO-3 over it), 20 steps each on a new packed sequence (its own plan, its own token count on each
    rank) after the warm-up: no graph compiled again (the rows are dynamic; a size of 0 or 1 rows, which torch
    specialises, would be at most one graph each: the bound is 2)."""
    for graphs, recompiles in spawned(2)["steady"]:
        assert graphs == 6 and recompiles <= 2, (graphs, recompiles)


def test_a_region_compiled_past_the_limit_raises_one_line():
    """A region whose inputs change type past torch._dynamo's recompile limit raises one line naming the region and
    the way out, instead of running eagerly from then on without a word."""
    import torch
    import torch._dynamo

    from flashpar.models.regions import compiled

    norm = compiled().norm
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1), pytest.raises(RuntimeError) as err:
        for dims in (2, 3):  # another number of dimensions: another graph
            norm(torch.ones((3,) * dims), torch.ones(3), 1e-5)
    assert "'norm' region was compiled 1 times" in str(err.value) and "\n" not in str(err.value), err.value
    torch._dynamo.reset()

"""No host synchronisation in a steady-state training step.

One ``flashpar.train.step.train_step`` of a ``ParallelLlama`` with 1, 2 and 3 layers on 4 gloo ranks,
meshes (dp, cp, tp) = (1, 2, 2) (TP-SP + FlashCP) and (2, 1, 2) (TP-SP + ZeRO-3), counted by
``step_sync_workers.Counting`` (every torch.distributed call, the cross-rank checks, flashpar's host
reads and host -> device copies).  What may grow with the layer count is the communication the
layer's methods need, derived from their schedules (``step_sync_workers.layer_comm``); the cross-rank
checks and the host transfers may not grow at all.

The per-op checks (``check=True`` in every linear and ``cp.attention`` call) fail this: each adds one
``exchange_metadata`` (an all-gather), its ``.cpu()`` and ``.tolist()`` calls per op, and
``cp.attention`` moves its batches' index tensors per call.
"""

from __future__ import annotations

import pytest

from dist_harness import SpawnCache
from step_sync_workers import COMM_KEYS, HOST_KEYS, bad_inputs, count_steps, micro_batch_checks

LAYERS = (1, 2, 3)
MESHES = (((1, 2, 2), "flash", "flashcp"),  # TP-SP (point-to-point) + FlashCP (p2p K/V exchange)
          ((2, 1, 2), "flash", "flashcp"),  # TP-SP + ZeRO-3 over dp
          ((1, 2, 2), "none", "headtail"))  # blocking TP collectives + the ring K/V exchange


def _calls(n: int):
    return [*((f"count {case}", count_steps, case[0], LAYERS, case[1], "zero3", case[2]) for case in MESHES),
            ("micro", micro_batch_checks, (1, 2, 2)), ("bad", bad_inputs, (1, 2, 2))]


spawn = SpawnCache(_calls, timeout=600.0)


def _per_rank(case):
    return spawn(4)[f"count {case}"]


@pytest.mark.parametrize("case", MESHES, ids=str)
def test_the_cross_rank_check_runs_once_per_step(case):
    """One ``exchange_metadata`` per step (``ParallelLlama``'s step check), whatever the depth: no op of the
    layer loop checks again (today's per-op checks: 6, 11, 16 at 1, 2, 3 layers)."""
    for rank, by_layers in enumerate(_per_rank(case)):
        meta = [by_layers[n][0].get("meta", 0) for n in LAYERS]
        assert meta == [1, 1, 1], (case, rank, meta)


@pytest.mark.parametrize("case", MESHES, ids=str)
def test_host_transfers_do_not_grow_with_the_layer_count(case):
    """flashpar reads nothing back to the host and copies no index tensor to the device inside the layer
    loop: the counts (the step check's reads of its gloo table, the position ids and the plan's index
    tensors, once per step) are the same at 1, 2 and 3 layers."""
    for rank, by_layers in enumerate(_per_rank(case)):
        host = {n: {k: by_layers[n][0].get(k, 0) for k in HOST_KEYS} for n in LAYERS}
        assert host[1] == host[2] == host[3], (case, rank, host)


@pytest.mark.parametrize("case", MESHES, ids=str)
def test_communication_grows_by_what_one_layer_needs(case):
    """Each added layer adds exactly its ops' communication: the transfers and collectives of their
    schedules (the TP linears' and the K/V exchange's, forward and backward), the ZeRO-3 gathers /
    reduce-scatters and the gradient sums of its parameters; no new groups in a steady-state step."""
    for rank, by_layers in enumerate(_per_rank(case)):
        counts = {n: {k: by_layers[n][0].get(k, 0) for k in COMM_KEYS} for n in LAYERS}
        need = {k: by_layers[1][1].get(k, 0) for k in COMM_KEYS}
        assert all({k: by_layers[n][1].get(k, 0) for k in COMM_KEYS} == need for n in LAYERS)  # one plan
        for k in COMM_KEYS:
            steps = [counts[2][k] - counts[1][k], counts[3][k] - counts[2][k]]
            assert steps == [need[k], need[k]], (case, rank, k, steps, need[k], counts)
        assert counts[1]["new_group"] == 0, (case, rank)
        assert need["p2p"] > 0, (case, rank, need)  # the count sees the layer's transfers at all


def test_the_step_trains():
    """The counted steps are real steps: finite losses, the same on every rank of a loss sum."""
    import math

    for case in MESHES:
        for by_layers in _per_rank(case):
            assert all(math.isfinite(by_layers[n][2]) for n in LAYERS)


BAD = {  # case: (the rank given the bad input, what its error says; None: every rank's error says it)
    "one rank drops a token": (1, "rank 1 (cp rank 0) has 54 tokens but the plan gives it 55"),
    "ranks pass different plans": (None, "ranks of dp replica 0 pass different plans"),
    "one rank's labels do not match its tokens": (2, "labels (54,) do not match tokens (55,)"),
    "one rank passes float tokens": (3, "tokens must be a 1-D integer tensor, got torch.float32"),
    "ranks disagree on the target count": (None, "ranks disagree on the global target count: [106, 105, 105, 105]"),
    "a plan for another cp size": (1, "the plan is for cp_size 1 but the mesh's cp dim has 2 ranks"),
    "one rank's model is float64": (None, "parameter dtype: ['float32', 'float32', 'float64', 'float32']"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_raises_one_line_on_every_rank(case):
    """The per-step check catches what the per-op checks caught for the trainer's inputs (token counts vs
    the plan, the plan, dtype, shapes): every rank raises (no hang) one line, the rank whose input is bad
    saying what is wrong with it, the others naming that rank."""
    errors = [out[case] for out in spawn(4)["bad"]]
    assert all(e is not None for e in errors), (case, errors)
    assert all("\n" not in msg and msg.startswith("ParallelLlama: ") for _, msg in errors), errors
    bad, says = BAD[case]
    for rank, (kind, msg) in enumerate(errors):
        if bad is None or rank == bad:
            assert says in msg and kind == "ValueError", (rank, msg)
        else:
            assert kind == "RuntimeError" and f"rank(s) [{bad}] rejected their input" in msg, (rank, msg)


def test_a_plan_is_placed_on_the_device_and_scheduled_once():
    """What ``cp.attention`` needs of a plan besides the tensors is built by its first call and shared by
    the later ones (every layer of a step): the layout with its index tensors on the device, and the
    exchange schedules (which depend only on the pattern, N and the rank)."""
    import torch

    from flashpar import cp
    from flashpar.cp.exchange import kv_schedule
    from flashpar.cp.layout import device_layout, rank_layout, to_device

    plan = cp.plan([5, 17, 3, 30, 8], 3)
    cpu = torch.device("cpu")
    for r in range(3):
        placed = device_layout(plan, r, False, cpu)
        assert device_layout(cp.plan([5, 17, 3, 30, 8], 3), r, False, cpu) is placed  # an equal plan: the same
        layout = rank_layout(plan, r, False)
        assert placed.layout is layout
        assert all(a is b for pa, pb in zip(placed.phases, layout.phases, strict=True)
                   for a, b in zip(pa, pb, strict=True))  # on its own device a batch is not copied
        for direction in ("forward", "backward"):
            assert kv_schedule(layout, direction) is kv_schedule(rank_layout(plan, r, True), direction)
    t = torch.arange(4)
    assert to_device(t, cpu) is t


def test_nccl_transfers_are_waited_for_by_the_stream_not_the_host():
    """``Work.wait(timeout)`` on NCCL blocks the host until the transfer is done (torch >= 2.4); the lane's
    and ZeRO's waits pass no timeout there (the stream waits), and keep it on gloo (the host waits)."""
    import datetime

    from flashpar.dist import stream_waits, wait_work

    class Work:
        def __init__(self):
            self.calls = []

        def wait(self, *args):
            self.calls.append(args)

    on_host, on_stream = Work(), Work()
    wait_work(on_host, 7.0, host=True)
    wait_work(on_stream, 7.0, host=False)
    assert on_host.calls == [(datetime.timedelta(seconds=7),)] and on_stream.calls == [()]
    assert not stream_waits(None)  # no process group here: nothing to wait for on a stream


def test_a_step_of_micro_batches_is_checked_once_and_a_bad_one_stops_every_rank():
    """Three micro-batches: one cross-rank check for the step (not one per forward); rank 1 drops a token of
    the second micro-batch: every rank raises one line before the step's first forward."""
    for rank, (checks, outcome) in enumerate(spawn(4)["micro"]):
        assert checks == 1, (rank, checks)
        assert outcome is not None and "\n" not in outcome[1], (rank, outcome)
        if rank == 1:  # its own error; the others name it
            assert outcome[0] == "ValueError" and "tokens but the plan gives it" in outcome[1], outcome
        else:
            assert outcome[0] == "RuntimeError" and "rank(s) [1] rejected their input" in outcome[1], (rank, outcome)

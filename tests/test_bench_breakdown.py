"""``flashpar.bench.breakdown``: each part is timed where it happens and the parts add up to the block's wall time.

Times are compared only with what the test itself makes slow (a sleep inside one part) or with the block's own wall
clock: never with a speed the machine must reach."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch.distributed import distributed_c10d as c10d

from flashpar.bench import breakdown as bd

SLEEP_S = 0.2  # long against what a loaded box can add to the step's few ms of Python (``other``)


def test_ops_are_counted_in_their_part():
    assert bd.part_of(torch.ops.aten.mm.default) == "linear"
    assert bd.part_of(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default) == "attention_fwd"
    assert bd.part_of(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default) == "attention_bwd"
    assert bd.part_of(torch.ops.aten._log_softmax.default) == "loss"
    assert bd.part_of(torch.ops._c10d_functional.all_gather_into_tensor.default) == "exposed_comm"
    assert bd.part_of(torch.ops.aten.mul.Tensor) == "elementwise"


class SlowOptimizer(torch.optim.SGD):
    def step(self, closure=None):
        time.sleep(SLEEP_S)
        return super().step(closure)


def test_a_training_step_is_split_into_its_parts_which_add_up_to_its_wall_time(monkeypatch):
    """A small attention + linear + cross-entropy step: attention forward / backward, linear and loss each measured
    (positive), the optimizer's sleep lands in ``optimizer`` (and in nothing else), a collective's sleep in
    ``exposed_comm``; the parts add up to the step's wall time."""

    def slow_all_reduce(tensor, *args, **kwargs):
        time.sleep(SLEEP_S)

    monkeypatch.setattr(c10d, "all_reduce", slow_all_reduce)
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    q = torch.randn(1, 2, 128, 32, requires_grad=True)
    opt = SlowOptimizer([w, q], lr=0.1)
    x, labels = torch.randn(256, 64), torch.randint(0, 64, (256,))

    def step():
        o = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        logits = (x @ w) + o.sum()
        F.cross_entropy(logits, labels).backward()
        c10d.all_reduce(w.grad)
        opt.step()
        opt.zero_grad()

    with bd.breakdown(optimizers=[opt]):  # the first step's and the first block's one-time costs (autograd's
        step()  # engine, the kernels' set-up, the dispatch mode's first entry) outside the measured block
    with bd.breakdown(optimizers=[opt]) as clock:
        clock.restart()
        step()
        ms = clock.finish()
    wall = ms.pop("wall_ms")
    assert set(ms) == set(bd.PARTS)
    for part in ("attention_fwd", "attention_bwd", "linear", "loss", "elementwise"):
        assert ms[part] > 0, (part, ms)
    assert ms["optimizer"] >= 1e3 * SLEEP_S and ms["exposed_comm"] >= 1e3 * SLEEP_S, ms
    # each sleep counted once: neither lands in another part (they take no op, so would show in other)
    assert ms["other"] < 1e3 * SLEEP_S, sorted(ms.items())
    # every interval between restart and finish counted once, for one part: the sum is the wall time up to the
    # float rounding of a few hundred additions of milliseconds (1e-9 relative is far above it)
    assert sum(ms.values()) == pytest.approx(wall, rel=1e-9)
    # step and zero_grad (and their ops, which count for the optimizer); the loss's forward and backward ops
    assert clock.entries["optimizer"] >= 2 and clock.entries["loss"] >= 2, clock.entries
    assert opt.step.__func__ is SlowOptimizer.step  # the class's method again after the block


def test_flashpar_loss_counts_as_loss_forward_and_backward():
    """``vocab_parallel_loss`` is elementwise ops; inside the block its forward and its backward (between the two
    markers) count for ``loss``: of the whole block only ``backward()``'s seed gradient (one op before the
    markers) and the leaf's gradient accumulation are left for ``elementwise``."""
    from flashpar.models import vocab

    logits = torch.randn(4096, 256, requires_grad=True)
    labels = torch.randint(0, 256, (4096,))
    with bd.breakdown() as clock:
        clock.restart()
        vocab.vocab_parallel_loss(logits, labels, 0, None, slice(None), 4096.0).backward()
        ms = clock.finish()
    # counted by entries, not by time (which the machine's load would move): outside the markers only the seed
    # gradient (ones_like) and its accumulation into ``logits.grad`` (detach), against dozens of loss ops
    assert ms["loss"] > 0 and clock.entries["elementwise"] <= 2 < 20 <= clock.entries["loss"], clock.entries
    assert vocab.vocab_parallel_loss.__name__ == "vocab_parallel_loss"  # rebound back


def test_a_region_counts_its_ops_and_its_communication_apart():
    """A region (``breakdown(regions={function: part})``) holds the ops of its function's calls, made through the
    module that binds it; a collective inside it still counts for ``exposed_comm``; the function is its own again
    after the block.  The clock moves only on the thread that made it: another thread's enter / leave (a lane's
    worker posting through a re-bound call) changes nothing."""
    import threading

    from flashpar.infer import sampling

    original = sampling.choose
    logits, u = torch.randn(8, 64), torch.rand(8, dtype=torch.float64)
    how = sampling.Sampling(temperature=0.7, top_k=5)
    with bd.breakdown(regions={original: "logits"}) as clock:
        clock.restart()
        sampling.choose(logits, u, how)
        worker = threading.Thread(target=lambda: (clock.enter("linear"), clock.leave()))
        worker.start()
        worker.join()
        ms = clock.finish()
    # the call and each of the sampler's ops (softmax, sort, cumsum, ...) enter it; none counts elsewhere
    assert ms["logits"] > 0 and clock.entries["logits"] > 5, clock.entries
    assert clock.entries["elementwise"] == 0 and clock.entries["linear"] == 0, clock.entries
    assert clock.cpu_ms["logits"] > 0 and set(clock.cpu_ms) == set(ms) - {"wall_ms"}
    assert sampling.choose is original


def test_a_collective_inside_a_region_counts_for_communication(monkeypatch):
    def slow_all_reduce(tensor, *args, **kwargs):
        time.sleep(SLEEP_S)

    monkeypatch.setattr(c10d, "all_reduce", slow_all_reduce)

    def summed(x):  # stands for a region that reduces across ranks
        return c10d.all_reduce(x.mul_(2))

    from flashpar.infer import comm

    monkeypatch.setattr(comm, "summed", summed, raising=False)
    with bd.breakdown(regions={summed: "logits"}) as clock:
        clock.restart()
        comm.summed(torch.ones(4))
        ms = clock.finish()
    assert ms["exposed_comm"] >= 1e3 * SLEEP_S and ms["logits"] < 1e3 * SLEEP_S, ms
    assert clock.entries["logits"] == 2 and clock.entries["exposed_comm"] == 1, clock.entries  # the call and mul_

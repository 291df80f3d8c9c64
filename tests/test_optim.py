"""The trainer's optimisation settings in one process: the learning-rate schedule, AdamW's parameter groups, the
grad-norm bookkeeping, the options' validation, and which sequences a resumed run with micro-batches reads.

The multi-rank parts (accumulated and clipped gradients, the global norm against the single-process model at
world sizes 1 to 4) are in tests/test_parallel_model.py, in its spawns.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashpar.models import Llama, LlamaConfig
from flashpar.models.grad_norm import counted_here
from flashpar.models.layout import mesh_name
from flashpar.train import checkpoint
from flashpar.train.config import TrainConfig
from flashpar.train.data import PackedCorpus, PlannedSequences, make_loader
from flashpar.train.loop import group_micro_batches
from flashpar.train.optimizer import decays, param_groups
from flashpar.train.schedule import lr_at


def test_schedule_warms_up_linearly_then_decays_by_a_cosine_to_lr_min():
    lr, lo, n, w = 1.0, 0.1, 10, 4
    rates = [lr_at(s, lr=lr, steps=n, warmup=w, lr_min=lo) for s in range(1, n + 1)]
    assert rates[:w] == [0.25, 0.5, 0.75, 1.0]  # lr / W, 2 lr / W, ..., lr (exact: k / 4)
    assert rates[-1] == pytest.approx(lo, abs=1e-15)  # the floor on the last step
    assert all(a > b for a, b in zip(rates[w - 1:], rates[w:], strict=False))  # strictly decreasing after W
    # the cosine's midpoint: halfway from W to N the rate is halfway between lr and lr_min
    assert lr_at(7, lr=lr, steps=n, warmup=w, lr_min=lo) == pytest.approx((lr + lo) / 2, abs=1e-15)
    # no warm-up: step 1 at lr_min + (lr - lr_min)(1 + cos(pi / N)) / 2; W = N: warm-up only
    assert lr_at(1, lr=lr, steps=n, lr_min=lo) == pytest.approx(lo + 0.9 * (1 + math.cos(math.pi / n)) / 2)
    assert [lr_at(s, lr=2.0, steps=2, warmup=2) for s in (1, 2)] == [1.0, 2.0]
    assert lr_at(1, lr=3.0, steps=1) == 0.0  # one step and no warm-up: the end of the decay, lr_min


@pytest.mark.parametrize("kw, words", [
    ({"step": 0}, r"step must be within \[1, 10\], got 0"),
    ({"step": 11}, r"step must be within \[1, 10\], got 11"),
    ({"warmup": 11}, r"warm-up must be within \[0, steps = 10\] steps, got 11"),
    ({"lr_min": 2.0}, r"lr-min must be within \[0, lr = 1.0\], got 2.0"),
])
def test_schedule_refuses_settings_outside_its_range(kw, words):
    args = {"step": 1, "lr": 1.0, "steps": 10, "warmup": 0, "lr_min": 0.0, **kw}
    with pytest.raises(ValueError, match=words):
        lr_at(args.pop("step"), **args)


def _mesh_parameters(cfg: LlamaConfig) -> dict[str, torch.nn.Parameter]:
    """A stand-in for ``ParallelLlama.named_parameters``: one parameter per mesh name of ``cfg``'s model."""
    names = sorted({mesh_name(n) for n, _ in Llama(cfg).named_parameters()})
    return {n: torch.nn.Parameter(torch.ones(3, 2) if decays(n) else torch.ones(2)) for n in names}


def test_weight_decay_groups_are_the_matrices():
    """Decay on the embedding, head and projections; none on the norm gains (the layout table's ``Replicated``
    rows).  AdamW with these groups on a mesh: tests/test_parallel_model.py."""
    params = _mesh_parameters(LlamaConfig(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, tie_embeddings=False))
    groups = param_groups(params.items(), 0.1)
    decayed = {n for n, p in params.items() if any(p is q for q in groups[0]["params"])}
    assert decayed == {n for n in params if n.split(".")[-2] in ("embed", "head", "qkv", "o_proj", "gate_up", "down")}
    assert {n.split(".")[-2] for n in params if n not in decayed} == {"attn_norm", "mlp_norm", "norm"}
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert sum(len(g["params"]) for g in groups) == len(params)
    with pytest.raises(ValueError, match="weight decay must be >= 0"):
        param_groups(params.items(), -1.0)


def test_each_copy_of_a_gradient_piece_is_counted_on_one_rank():
    """Over every rank of a (dp, cp, ulysses, tp) mesh, each grad_sum kind's pieces are counted once: ``copy``
    (the whole parameter) on one rank, ``shard`` once per tp rank, ``zero`` (rows held by one rank alone) on
    every rank."""
    dp, cpn, un, tp = 2, 3, 2, 2
    coords = [(d, c, u, t) for d in range(dp) for c in range(cpn) for u in range(un) for t in range(tp)]
    for kind, want in (("copy", [(0, 0, 0, 0)]), ("shard", [(0, 0, 0, t) for t in range(tp)]),
                       ("zero", coords)):
        got = [x for x in coords if counted_here(kind, dp_rank=x[0], cp_rank=x[1], u_rank=x[2], tp_rank=x[3])]
        assert got == want, kind
    with pytest.raises(ValueError, match="unknown grad_sum kind 'rows'"):
        counted_here("rows", dp_rank=0, cp_rank=0, u_rank=0, tp_rank=0)


@pytest.mark.parametrize("kw, words", [
    ({"micro_batches": 0}, "micro-batches must be an integer >= 1, got 0"),
    ({"warmup": 5, "steps": 4}, r"warmup must be an integer within \[0, --steps = 4\], got 5"),
    ({"lr_min": 1.0}, r"lr-min must be within \[0, --lr = 0.003\], got 1.0"),
    ({"clip": -1.0}, "weight-decay and clip must be >= 0"),
    ({"weight_decay": -0.1}, "weight-decay and clip must be >= 0"),
])
def test_bad_optim_settings_are_named_in_one_line(kw, words):
    with pytest.raises(ValueError, match=words) as err:
        TrainConfig(**kw)
    assert "\n" not in str(err.value)
    assert TrainConfig().final_lr == pytest.approx(3e-4) and TrainConfig(lr_min=0.0).final_lr == 0.0


def test_a_resumed_run_with_micro_batches_reads_the_next_sequences():
    """Dp rank ``d``'s micro-batch ``m`` of step ``s`` is global sequence ``(s M + m) dp + d``; after ``k`` steps
    the checkpoint's ``sequences`` (``k dp M``) start a loader whose first step is the uninterrupted run's
    step ``k``, on every dp rank (the loader's items, grouped as the training loop groups them)."""
    data = PackedCorpus(64, max_docs=40, seed=0)
    dp, micro, k, steps = 2, 3, 2, 4

    def step_indices(start: int, d: int, n: int) -> list[list[int]]:  # the global indices of n steps of rank d
        planned = PlannedSequences(data, 1, "per_doc", dp_rank=d, dp_size=dp, start=start)
        groups = group_micro_batches(make_loader(planned, num_workers=0), micro)
        return [[it["index"] for it in group] for _, group in zip(range(n), groups, strict=False)]

    start = checkpoint.sequences_after(0, k, dp, micro)
    assert start == k * dp * micro
    for d in range(dp):
        straight = step_indices(0, d, steps)
        assert straight == [[(s * micro + m) * dp + d for m in range(micro)] for s in range(steps)]
        assert step_indices(start, d, steps - k) == straight[k:]
    # a resumed run's own checkpoint counts from where it started, whatever its dp and micro-batches
    assert checkpoint.sequences_after(start, 1, 1, 2) == start + 2
    assert list(group_micro_batches(range(7), 3)) == [[0, 1, 2], [3, 4, 5]]  # the incomplete group is dropped

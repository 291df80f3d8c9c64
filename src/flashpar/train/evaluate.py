"""The validation loss (``--eval-every K``): the mesh model on the held-out documents, without gradients.

The held-out documents (``--eval-docs``: the last ones of the seed's shuffled order, never in the
training stream; ``flashpar.train.data.training_data(config, "eval")``) are packed like the training
ones into ``E`` sequences of ``seq_len``; ``E' = D * (E // D)`` of them are used, dp rank ``d`` of
``D`` taking ``d, d + D, ...`` (every dp rank the same number of forwards: a ZeRO-3 forward gathers
weights over dp).  Each is planned for context parallelism once, when the run starts, and its cp
rank's tokens and labels stay on the device.  With ``C`` the targets (labels != -100) of the
``E'`` sequences, counted by every rank from their labels (no communication)::

    eval_loss = sum over the E' sequences and every position p with a target  -log softmax(logits_p)[label_p] / C

Each rank's forward returns its share of that sum (``ParallelLlama.forward`` with ``count = C``); the
shares are added on the device and summed over all ranks by one all-reduce per evaluation, which is
then read on the host; the inputs are checked across ranks once per evaluation
(``ParallelLlama.check_step``).  Nothing is read back inside the forwards.

    rank (d, c, t):  [fwd seq d]  [fwd seq d + D]  ...  -> share_d,c,t      all_reduce(sum) over the world
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from flashpar import cp
from flashpar.train import where
from flashpar.train.data import IGNORE_INDEX, PackedCorpus


class HeldOut:
    """This rank's held-out sequences, planned and sharded once; ``loss(model)`` is the validation loss."""

    def __init__(self, dataset: PackedCorpus, cp_size: int, strategy: str, cost, *, dp_rank: int, dp_size: int,
                 cp_rank: int, device, every: int = 1):
        per_rank = len(dataset) // dp_size
        if per_rank == 0:
            raise ValueError(f"the held-out documents make {len(dataset)} sequences of {dataset.seq_len} tokens, "
                             f"fewer than dp = {dp_size}; raise --eval-docs")
        used = [dataset[i] for i in range(per_rank * dp_size)]
        self.count = float(sum(int((item["labels"] != IGNORE_INDEX).sum()) for item in used))
        self.sequences = per_rank * dp_size
        self.items = []
        for item in used[dp_rank::dp_size]:
            plan = cp.plan(item["doc_lens"], cp_size, strategy=strategy, cost=cost)
            self.items.append((cp.shard(item["tokens"], plan, cp_rank).to(device),
                               cp.shard(item["labels"], plan, cp_rank).to(device), plan))
        self.device, self.every = device, every

    def loss(self, model) -> float:
        """The mean next-token loss of the held-out targets (collective: every rank of the mesh calls it)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        model.check_step(self.items, self.count)  # one cross-rank check for all the forwards, as a training step
        with torch.no_grad():
            for tokens, labels, plan in self.items:
                where.enter("evaluate")  # each sequence a stamp: a long evaluation is progress (train.watchdog)
                total += model(tokens, plan, labels, self.count, checked=True).double()
        dist.all_reduce(total)
        return float(total)


def held_out(config, cost, mesh, device) -> HeldOut | None:
    """The run's held-out sequences on this rank, or ``None`` without ``--eval-every``."""
    if not config.eval_every:
        return None
    from flashpar.train.data import training_data

    return HeldOut(training_data(config, "eval"), config.cp, config.strategy, cost, dp_rank=mesh["dp"].get_local_rank(),
                   dp_size=config.dp, cp_rank=mesh["cp"].get_local_rank(), device=device, every=config.eval_every)


def at_step(evaluator: HeldOut | None, model, metrics, step: int, steps: int):
    """``metrics`` with the validation loss when step ``step`` (1-based) is an evaluation step: every
    ``--eval-every`` steps and the last one."""
    if evaluator is None or (step % evaluator.every and step != steps):
        return metrics
    return dataclasses.replace(metrics, eval_loss=evaluator.loss(model))

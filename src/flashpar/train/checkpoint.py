"""Checkpoints of the trainer with ``torch.distributed.checkpoint``, resumable on another mesh shape.

A checkpoint holds the model and the AdamW moments as the single-process model's *full* tensors,
under its parameter names (tp shards gathered with ``ParallelLlama.to_full``): every rank holds the
same values, which DCP writes once.  Loading fills full tensors and each rank takes its shards
(``ParallelLlama.shard_of``), whatever the mesh was when saving: both read the parameter-layout table
``flashpar.models.layout.LAYOUT``.  ``meta.json`` (rank 0) records the
step, the global sequences consumed (``sequences_after``: ``steps x dp x micro-batches`` from the
start; the data loader resumes there, whatever the new run's dp and micro-batches) and what must
not change across a resume (``TrainConfig.kept()``: model sizes, sequence length, corpus and seed).
The AdamW state is keyed by parameter (``opt.state``), whatever its parameter groups
(``flashpar.train.optimizer``); the learning rate is not saved: it is a function of the step
(``flashpar.train.schedule``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from flashpar.models import LlamaConfig
from flashpar.train.config import TrainConfig

MOMENTS = ("exp_avg", "exp_avg_sq")
PRE_ISSUE_13 = {"data": None, "tokenizer": None, "held_out": 0}  # what a checkpoint without these keys was made with


def sequences_after(start: int, steps: int, dp: int, micro_batches: int) -> int:
    """The global sequences consumed once ``steps`` steps of ``micro_batches`` sequences per dp rank (``dp``
    ranks) have run from global sequence ``start``: dp rank ``d``'s micro-batch ``m`` of step ``s`` (0-based,
    counted from ``start``) is the global sequence ``start + (s M + m) dp + d``."""
    return start + steps * dp * micro_batches


def save(path: Path, model, opt, step: int, config: TrainConfig, sequences: int | None = None) -> None:
    """Write step ``step`` to ``path`` (collective: every rank calls it); ``sequences``: the global sequences
    consumed (default: a run from sequence 0 with this config's dp and micro-batches)."""
    if sequences is None:
        sequences = sequences_after(0, step, config.dp, config.micro_batches)
    state = _full_state(model, opt)
    dcp.save(state, checkpoint_id=str(path))
    if dist.get_rank() == 0:
        meta = {"step": step, "sequences": sequences, "mesh": [config.dp, config.cp, config.ulysses, config.tp],
                "micro_batches": config.micro_batches, **config.kept()}
        (path / "meta.json").write_text(json.dumps(meta, indent=1))
    dist.barrier()


def latest(path: Path) -> Path:
    """``path`` itself if it is a checkpoint, else its newest ``step_*`` checkpoint."""
    if (path / "meta.json").is_file():
        return path
    steps = sorted(path.glob("step_*/meta.json"), key=lambda p: int(p.parent.name.split("_")[1]))
    if not steps:
        raise FileNotFoundError(f"no checkpoint (meta.json) at {path} or in its step_* folders")
    return steps[-1].parent


def read_meta(path: Path, config: TrainConfig) -> dict:
    """The checkpoint's meta data; ``ValueError`` if the run would not continue the same training."""
    where = latest(path) / "meta.json"
    try:
        meta = json.loads(where.read_text())
        if not isinstance(meta, dict) or not all(isinstance(meta.get(k), int) for k in ("step", "sequences")):
            raise ValueError("no integer step and sequences")
        # a checkpoint written before a setting existed was made with its default (issue 13 added data,
        # tokenizer, held_out and model fields); the model dict is read back through LlamaConfig
        meta = {**PRE_ISSUE_13, **meta}
        meta["model"] = LlamaConfig(**meta["model"]).to_dict() if isinstance(meta.get("model"), dict) else None
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"checkpoint {where} is not a flashpar meta.json: {err}") from None
    kept = config.kept()
    differ = [k for k in kept if meta.get(k) != kept[k]]
    if differ:
        raise ValueError(f"checkpoint {path} was made with other {', '.join(differ)}: "
                         + "; ".join(f"{k} {meta.get(k)} != {kept[k]}" for k in differ))
    return meta


def load(path: Path, model, opt) -> None:
    """Fill this rank's parameters and AdamW state from the checkpoint (collective)."""
    state = _full_state(model, opt, empty=True)
    dcp.load(state, checkpoint_id=str(latest(path)))
    step = float(state["optim"]["step"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(model.shard_of(name, state["model"]))
            opt.state[p] = {"step": torch.tensor(step),
                            **{m: model.shard_of(name, state[m]).clone().to(p.device) for m in MOMENTS}}


def _full_state(model, opt, empty: bool = False) -> dict:
    params = dict(model.named_parameters())
    moments = {m: {n: opt.state.get(p, {}).get(m, torch.zeros_like(p)) for n, p in params.items()} for m in MOMENTS}
    state = {"model": model.to_full({n: p.detach() for n, p in params.items()}),
             **{m: model.to_full(moments[m]) for m in MOMENTS}}
    steps = [float(s["step"]) for s in opt.state.values() if "step" in s]
    state["optim"] = {"step": torch.tensor(max(steps, default=0.0), dtype=torch.float64)}
    if empty:
        state = {k: {n: torch.empty_like(t) for n, t in v.items()} for k, v in state.items()}
    return {k: {n: t.cpu() for n, t in v.items()} for k, v in state.items()}

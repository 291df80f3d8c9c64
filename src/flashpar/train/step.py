"""One rank's model and one optimizer step, with no bookkeeping: the part of training tests call directly.

    build(config, mesh, device)    -> (cfg, ParallelLlama with its shards of one seeded Llama, AdamW)
    planner_cost(cfg)              the planner's cost model with the model's shape
    forward_backward(model, ...)   loss share; backward; gradients summed over the ranks holding copies
    train_step(model, opt, ...)    forward_backward, AdamW step, gradients cleared

Every rank of the mesh calls each function together (they are collective).  ``train_step`` makes no
host synchronisation: the loss comes back as a detached tensor on the model's device; reading it
(``float(loss)``) is the caller's, after the step.
"""

from __future__ import annotations

import torch

from flashpar.cp import CostModel
from flashpar.models import Llama, LlamaConfig
from flashpar.models.parallel import ParallelLlama
from flashpar.models.precision import DTYPES
from flashpar.train.config import TrainConfig


def build(config: TrainConfig, mesh, device) -> tuple:
    """``(cfg, model, opt)``: the mesh model holding this rank's shards of ``Llama(config.model)`` made after
    ``torch.manual_seed(config.seed)`` (every rank the same weights), and its AdamW."""
    cfg = config.model
    torch.manual_seed(config.seed)
    full = Llama(cfg)
    model = ParallelLlama(cfg, mesh, mode=config.mode, timeout_s=config.timeout, dp_mode=config.dp_mode,
                          dtype=DTYPES[config.dtype], checkpoint_activations=config.checkpoint_activations)
    model.load_full(full)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.1)
    return cfg, model, opt


def planner_cost(cfg: LlamaConfig, dtype_bytes: int = 4) -> CostModel:
    """The cost model the trainer's plans are made with: this model's shape, activations of ``dtype_bytes``
    (fp32: 4, ``--dtype bf16``: 2), the default device rates."""
    return CostModel(hidden=cfg.hidden, ffn=cfg.ffn, heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                     layers=cfg.layers, dtype_bytes=dtype_bytes)


def forward_backward(model: ParallelLlama, tokens_cp: torch.Tensor, labels_cp: torch.Tensor, plan,
                     count: float) -> torch.Tensor:
    """This rank's share of the loss (``ParallelLlama.forward``: the cp rank's tokens / targets of ``plan``,
    ``count`` the global batch's targets), after backward and ``reduce_grads``."""
    loss = model(tokens_cp, plan, labels_cp, count)
    model.sum_grads_in_backward()  # each gradient's sum travels while backward computes the earlier layers
    loss.backward()
    model.reduce_grads()
    return loss.detach()


def train_step(model: ParallelLlama, opt: torch.optim.Optimizer, tokens_cp: torch.Tensor, labels_cp: torch.Tensor,
               plan, count: float) -> torch.Tensor:
    """One optimizer step: ``forward_backward``, ``opt.step()``, gradients cleared.  Returns this rank's share
    of the loss (summed over all ranks: the mean next-token loss of the global batch)."""
    loss = forward_backward(model, tokens_cp, labels_cp, plan, count)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss

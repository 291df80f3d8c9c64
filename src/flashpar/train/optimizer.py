"""The trainer's AdamW: decoupled weight decay on the matrices, none on the norm gains, the rate set per step.

Two parameter groups, made from the parameter-layout table (``flashpar.models.layout.LAYOUT``):

    group      LAYOUT rows                                         weight decay
    decay      Rows, Columns, FusedRows: the embedding, the head,  --weight-decay
               q/k/v, attention out, gate/up, mlp down
    no decay   Replicated: the RMSNorm gains (q/k norms too),      0
               the biases of the families that have them

AdamW's decay is decoupled (Loshchilov & Hutter): each step ``p <- p - lr_t * wd * p`` beside the Adam
update, ``lr_t`` the step's rate (``flashpar.train.schedule``), not an L2 term in the gradient.  The norm
gains are left alone, as Megatron-LM (no decay on biases and 1-D parameters), Hugging Face's
``Trainer`` (no decay on LayerNorm weights and biases) and nanoGPT (no decay below 2 dims) do: a gain
scales a normalised activation, and pulling it towards 0 shrinks the layer's output instead of
regularising a weight matrix.  The optimizer state stays keyed by parameter (``opt.state``), which
checkpoints walk whatever the groups (``flashpar.train.checkpoint``).
"""

from __future__ import annotations

import torch

from flashpar.models.layout import layout_of

BETAS = (0.9, 0.95)


def decays(name: str) -> bool:
    """Whether mesh parameter ``name`` gets weight decay: the tp-split weights of ``LAYOUT`` (not the norm gains,
    not the biases)."""
    return layout_of(name)[0].decays


def param_groups(named_parameters, weight_decay: float) -> list[dict]:
    """AdamW's groups ``[decay, no decay]`` of ``named_parameters`` (``(mesh name, parameter)`` pairs)."""
    if not weight_decay >= 0:
        raise ValueError(f"weight decay must be >= 0, got {weight_decay}")
    named = list(named_parameters)
    groups = [{"params": [p for n, p in named if decays(n)], "weight_decay": weight_decay, "name": "decay"},
              {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


def adamw(model: torch.nn.Module, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters in the groups of ``param_groups``."""
    return torch.optim.AdamW(param_groups(model.named_parameters(), weight_decay), lr=lr, betas=BETAS)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """The rate of the next ``opt.step()`` on every group (a host float: no device work)."""
    for group in opt.param_groups:
        group["lr"] = lr

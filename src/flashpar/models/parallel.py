"""The Llama decoder on a (dp, cp, tp) device mesh: tensor + sequence parallel, context parallel, data parallel.

One rank holds, of one packed sequence and its ``CPPlan`` over the ``cp`` ranks:

    cp:  the tokens ``plan.local_indices(cp_rank)`` (T_cp of them, in the plan's local order)
    tp:  a contiguous block of those rows between the blocks (``split_sizes``, sequence parallel),
         all of them and 1/tp of the heads / FFN columns inside attention and the MLP

    x_shard   = reduce_scatter_tp(embed_t(tokens))                          [T_cp/tp, h]   (vocab rows t)
    qkv       = all_gather_matmul(norm(x_shard), w_qkv[tp rank])            [T_cp, (H + 2 H_kv) D / tp]
    o         = cp.attention(rope(q), rope(k), v, plan, group=cp)          [T_cp, H / tp, D]
    x_shard  += matmul_reduce_scatter(o, w_o[:, tp rank])                  [T_cp/tp, h]
    x_shard  += matmul_reduce_scatter(silu(g) u, w_down[:, tp rank]),  (g, u) = all_gather_matmul(norm(x_shard), w_gu)
    logits_t  = all_gather_matmul(norm(x_shard), head_t)                   [T_cp, vocab / tp]
    loss      = vocab-parallel cross-entropy of this tp rank's rows        (``flashpar.models.vocab``)

The all-gathers and reduce-scatters are FlashOverlap's (``mode``), the K/V exchange FlashCP's.
The fused QKV (and gate / up) weight of a tp rank stacks its heads' rows of q, k and v, so one
all-gather feeds all three.  Embedding and head hold the tp rank's vocabulary rows; the norms are
replicated.  How each parameter is split is the one table ``flashpar.models.layout.LAYOUT``, read
by loading (``shard_of``), checkpoints (``to_full``), the gradient sums and ``--check``.

Data parallelism: ``dp_mode="zero3"`` (the default) keeps on each dp rank only its rows of the tp
shards (and their optimizer state), gathered over dp before use and reduce-scattered in backward
(``flashpar.models.zero``); ``"replicate"`` keeps whole copies.  Embedding, head (vocabulary
rows of the tp rank) and norms are not split over dp.

Gradients: a parameter's gradient on a rank covers that rank's tokens only, and the loss is
normalised by the global number of targets, so gradients are summed over every rank that holds a
copy (``reduce_grads``): the tp shards over the cp x dp ranks of their tp index (ZeRO-3 rows: over
cp, the reduce-scatter summed over dp), the norms over the whole mesh.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flashpar import cp
from flashpar.cp.layout import to_device
from flashpar.dist import DEFAULT_TIMEOUT_S
from flashpar.models.config import LlamaConfig
from flashpar.models.layout import LAYOUT, layout_of
from flashpar.models.llama import Llama, RMSNorm, rope
from flashpar.models.step_check import StepCheck
from flashpar.models.vocab import embed_rows, vocab_parallel_loss
from flashpar.models.zero import gather_rows
from flashpar.overlap.ops import all_gather_matmul
from flashpar.rows import row_sizes, shard_rows


class ParallelBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp_group, cp_group, mode: str, timeout_s: float, dp_group=None) -> None:
        super().__init__()
        tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.cfg, self.tp, self.cp_group = cfg, tp, cp_group
        self.heads, self.kv_heads = cfg.heads // tp, cfg.kv_heads // tp
        h, d = cfg.hidden, cfg.head_dim
        self.attn_norm = RMSNorm(h, cfg.norm_eps)
        kw = {"bias": False, "group": tp_group, "mode": mode, "timeout_s": timeout_s}
        self.timeout_s = timeout_s
        zero3 = dp_group is not None  # ZeRO-3: each dp rank keeps rows of the tp shards
        if zero3:
            kw["dp_group"] = dp_group
        self.qkv = LAYOUT["qkv"].linear(zero3)(h, (cfg.heads + 2 * cfg.kv_heads) * d, **kw)
        self.o_proj = LAYOUT["o_proj"].linear(zero3)(cfg.heads * d, h, **kw)
        self.mlp_norm = RMSNorm(h, cfg.norm_eps)
        self.gate_up = LAYOUT["gate_up"].linear(zero3)(h, 2 * cfg.ffn, **kw)
        self.down = LAYOUT["down"].linear(zero3)(cfg.ffn, h, **kw)
        self.kv_counter: cp.CommCounter | None = None  # set by ParallelLlama: K/V bytes of cp.attention

    def forward(self, x: torch.Tensor, positions: torch.Tensor, plan, split: list[int]) -> torch.Tensor:
        cfg, d, t = self.cfg, self.cfg.head_dim, positions.shape[0]
        # check=False: ParallelLlama.forward checked this step's inputs across ranks once (models/step_check.py)
        qkv = self.qkv(self.attn_norm(x), split_sizes=split, check=False)
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q = rope(q.reshape(t, self.heads, d), positions, cfg.rope_theta)
        k = rope(k.reshape(t, self.kv_heads, d), positions, cfg.rope_theta)
        o = cp.attention(q, k, v.reshape(t, self.kv_heads, d), plan, group=self.cp_group, counter=self.kv_counter,
                         timeout_s=self.timeout_s, check=False)
        x = x + self.o_proj(o.reshape(t, -1), split_sizes=split, check=False)
        g, u = self.gate_up(self.mlp_norm(x), split_sizes=split, check=False).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u, split_sizes=split, check=False)


class ParallelLlama(nn.Module):
    """The decoder on a mesh with dims ``("dp", "cp", "tp")`` (any of them may have size 1)."""

    def __init__(self, cfg: LlamaConfig, mesh, *, mode: str = "flash", timeout_s: float = DEFAULT_TIMEOUT_S,
                 dp_mode: str = "zero3") -> None:
        super().__init__()
        if dp_mode not in ("zero3", "replicate"):
            raise ValueError(f"ParallelLlama: dp_mode must be 'zero3' or 'replicate', got {dp_mode!r}")
        self.cfg, self.mesh = cfg, mesh
        self.dp, self.dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
        self.zero = dp_mode == "zero3" and self.dp > 1
        dp_group = mesh["dp"].get_group() if self.zero else None
        self.tp_group, self.cp_group = mesh["tp"].get_group(), mesh["cp"].get_group()
        self.tp, self.tp_rank = mesh["tp"].size(), mesh["tp"].get_local_rank()
        self.cp_rank = mesh["cp"].get_local_rank()
        for name, size in (("heads", cfg.heads), ("kv_heads", cfg.kv_heads), ("ffn", cfg.ffn),
                           ("vocab_size", cfg.vocab_size)):
            if size % self.tp:
                raise ValueError(f"ParallelLlama: {name} = {size} is not divisible by tp = {self.tp}")
        self.mode, self.vocab_lo = mode, self.tp_rank * cfg.vocab_size // self.tp
        self.embed = nn.Embedding(cfg.vocab_size // self.tp, cfg.hidden)  # this tp rank's vocabulary rows
        self.blocks = nn.ModuleList(ParallelBlock(cfg, self.tp_group, self.cp_group, mode, timeout_s, dp_group)
                                    for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden, cfg.vocab_size // self.tp, bias=False)
        self._sum_groups = _sum_groups(mesh)
        self.step_check = StepCheck(mesh, (cfg, mode, dp_mode, tuple(mesh.mesh.shape), mesh.mesh_dim_names),
                                    timeout_s=timeout_s)  # the cross-rank check of each step's inputs
        self.kv_counter = cp.CommCounter()  # bytes this rank's attention sent and received, all layers
        for block in self.blocks:
            block.kv_counter = self.kv_counter

    # ------------------------------------------------------------------------------------------
    # weights

    def load_full(self, model: Llama) -> None:
        """Take this rank's shards of a single-process model's weights (every rank the same model)."""
        full = dict(model.named_parameters())
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(self.shard_of(name, full))

    def shard_of(self, name: str, full: dict[str, torch.Tensor]) -> torch.Tensor:
        """This rank's part of parameter ``name`` built from the full model's tensors ``full``."""
        layout, names = layout_of(name)
        part = layout.shard([full[n] for n in names], self.tp_rank, self.tp)
        if self.zero and layout.zero:
            lo, hi = shard_rows(part.shape[0], self.dp, self.dp_rank)
            part = part[lo:hi]
        return part

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Gradients under the single-process model's parameter names (tp shards all-gathered)."""
        params = self.named_parameters()
        return self.to_full({n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in params})

    def to_full(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-parameter tensors of this rank (parameters, gradients, optimizer moments: ``local[name]`` shaped
        like parameter ``name``) as the single-process model's full tensors, under its names; the inverse
        of ``shard_of``.  A collective over the tp group."""
        out = {}
        modules = dict(self.named_modules())
        for name, g in local.items():
            layout, names = layout_of(name)
            if self.zero and layout.zero:  # the dp rows first: the whole tp shard
                rows = modules[name.rsplit(".", 1)[0]].total_rows
                with torch.no_grad():
                    g = gather_rows(g.detach(), self.mesh["dp"].get_group(), rows)
            out.update(zip(names, layout.unshard(g, self._gather_tp, self.cfg, self.tp), strict=True))
        return out

    def _gather_tp(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.tp == 1:
            return x.clone()
        parts = [torch.empty_like(x) for _ in range(self.tp)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)

    def reduce_grads(self) -> None:
        """Sum every gradient over the ranks that hold a copy of its parameter (see the module docstring)."""
        for name, p in self.named_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            group = self._sum_groups[layout_of(name)[0].grad_sum(self.zero)]
            if group is not None:
                dist.all_reduce(p.grad, group=group)

    # ------------------------------------------------------------------------------------------
    # forward

    def forward(self, tokens_cp: torch.Tensor, plan, labels_cp: torch.Tensor, count: float) -> torch.Tensor:
        """This rank's share of the loss: ``tokens_cp`` / ``labels_cp`` are the cp rank's tokens and targets
        (``cp.shard(x, plan, cp_rank)``), ``count`` the global batch's number of targets; the shares of all
        ranks add up to the mean next-token loss.  Every rank raises (one line) on bad or disagreeing inputs,
        checked once here; the layers' ops run unchecked (``flashpar.models.step_check``)."""
        self.step_check(tokens_cp, labels_cp, plan, count, self.embed.weight, auto=self.mode == "auto")
        split = row_sizes(tokens_cp.shape[0], self.tp)
        start = sum(split[: self.tp_rank])
        rows = slice(start, start + split[self.tp_rank])
        positions = to_device(plan.position_ids(self.cp_rank), tokens_cp.device)  # no host wait on CUDA
        x = embed_rows(tokens_cp, self.embed.weight, self.vocab_lo, self.tp_group)
        for block in self.blocks:
            x = block(x, positions, plan, split)
        head = self.embed.weight if self.head is None else self.head.weight
        logits = all_gather_matmul(self.norm(x), head, None, group=self.tp_group, mode=self.mode, split_sizes=split,
                                   check=False)
        return vocab_parallel_loss(logits, labels_cp, self.vocab_lo, self.tp_group, rows, count)


def _sum_groups(mesh) -> dict[str, dist.ProcessGroup | None]:
    """The ranks a gradient is summed over: ``shard`` (a tp shard: the ranks with this rank's tp index,
    cp x dp), ``zero`` (a ZeRO-3 row block, whose reduce-scatter already summed over dp: the cp group),
    ``copy`` (replicated: the whole mesh).  Every rank creates every group in the same order
    (``new_group`` is collective); ``None`` where the group is this rank alone."""
    ranks = mesh.mesh  # [dp, cp, tp] global ranks
    dp, cpn, tp = ranks.shape
    me = dist.get_rank()
    groups: dict[str, dist.ProcessGroup | None] = {"shard": None, "copy": None,
                                                  "zero": mesh["cp"].get_group() if cpn > 1 else None}
    if dp * cpn > 1:
        for t in range(tp):
            members = ranks[:, :, t].flatten().tolist()
            g = dist.new_group(members)
            if me in members:
                groups["shard"] = g
    if dp * cpn * tp > 1:
        groups["copy"] = dist.new_group(ranks.flatten().tolist())
    return groups

"""The Llama decoder on a (dp, cp, ulysses, tp) device mesh: tensor + sequence parallel, Ulysses, context
parallel, data parallel.

One rank holds, of one packed sequence and its ``CPPlan`` over the ``cp`` ranks:

    cp:       the tokens ``plan.local_indices(cp_rank)`` (T_cp of them, in the plan's local order)
    ulysses:  the contiguous block ``row_sizes(T_cp, U)[u]`` of those (T_u; all of them when U = 1) between
              the attention blocks, and all T_cp tokens for 1/U of the heads inside attention
    tp:       a contiguous block of the T_u rows between the blocks (``split_sizes``, sequence parallel),
              all of them and 1/tp of the heads / FFN columns inside attention and the MLP

Tensor parallelism (U = 1):

    x_shard   = reduce_scatter_tp(embed_t(tokens))                          [T_cp/tp, h]   (vocab rows t)
    qkv       = all_gather_matmul(norm(x_shard), w_qkv[tp rank])            [T_cp, (H + 2 H_kv) D / tp]
    o         = cp.attention(rope(q), rope(k), v, plan, group=cp)          [T_cp, H / tp, D]
    x_shard  += matmul_reduce_scatter(o, w_o[:, tp rank])                  [T_cp/tp, h]
    x_shard  += matmul_reduce_scatter(silu(g) u, w_down[:, tp rank]),  (g, u) = all_gather_matmul(norm(x_shard), w_gu)
    logits_t  = all_gather_matmul(norm(x_shard), head_t)                   [T_cp, vocab / tp]
    loss      = vocab-parallel cross-entropy of this tp rank's rows        (``flashpar.models.vocab``)
    (a vocabulary smaller than T_cp: embed_t and head_t all-gathered instead, each rank its rows whole)

Ulysses (U > 1, tp = 1: both split the heads, so they do not compose here), USP style: Ulysses inside,
context parallelism outside.  Ulysses rank u of the cp rank attends with head group u (``head_layout``:
H / U query heads, max(H_kv / U, 1) kv heads; fewer kv heads than U are replicated):

    x_u       = embed(tokens[block u])                                      [T_u, h]
    qkv       = matmul_all_to_all(norm(x_u), w_qkv grouped by head group)   [T_cp, (H / U + 2 h_kv) D]
    o         = cp.attention(rope(q), rope(k), v, plan, group=cp)          [T_cp, H / U, D]
    x_u      += all_to_all_matmul(o, w_o)                                   [T_u, h]
    x_u      += down(silu(g) u),  (g, u) = gate_up(norm(x_u))               (the rows T_u)
    loss      = cross-entropy of the rows T_u

The all-to-alls are FlashOverlap's (``flashpar.overlap.a2a``: each fused with the projection on its
side); the rope positions of all T_cp tokens are the plan's (``plan.position_ids(cp_rank)``), known
on every rank.  Rope's cos / sin tables are made once per step and shared by the layers, and rope and
SwiGLU run as one autograd node each on the fused GEMM outputs (``flashpar.models.fused``).
``w_qkv`` stays ``cat(q, k, v)``; each forward regroups its rows by head group
(``ulysses_qkv_rows``: [q_g; k_g; v_g] for g = 0..U-1), and the autograd of that gather sums the
gradient of a kv head replicated on several groups.

    ulysses rank u of U = 2 (one cp rank):  rows T_0 | T_1  --a2a-->  heads 0..H/2 | H/2..H of T_0 T_1
    in flight (matmul_all_to_all, flash):   lane: x_u W_{1-u} -> peer, T_{1-u} W_u <- peer
                                            main: x_u W_{1-u}  then  x_u W_u (own group, covers the send)

The all-gathers and reduce-scatters are FlashOverlap's (``mode``), the K/V exchange FlashCP's.
The fused QKV (and gate / up) weight of a tp rank stacks its heads' rows of q, k and v, so one
all-gather feeds all three.  Embedding and head hold the tp rank's vocabulary rows; the norms are
replicated.  How each parameter is split is the one table ``flashpar.models.layout.LAYOUT``, read
by loading (``shard_of``; ``load_hf_slices``: a Hugging Face folder, each rank reading only its slices),
checkpoints (``to_full``), the gradient sums and ``--check``.

Data parallelism: ``dp_mode="zero3"`` (the default) splits every tp shard (projections, embedding and head:
every weight but the norm gains) by rows over the shard group, the dp x cp x ulysses ranks of the rank's tp
index, which hold the same shard, with its gradient and optimizer state (torchtitan's FSDP over
dp_shard x cp).  A block either gathers its weights ahead (``prefetch``: one unit per block, gathered while
the blocks before it compute, its GEMMs undivided, its gradients reduce-scattered as its backward ends:
``flashpar.overlap.prefetch``) or fuses the gather with its GEMMs, one piece per peer (``fused``:
``flashpar.overlap.sharded``); ``zero_schedule`` says which, per block (``flashpar.models.zero_units``).
``mode="none"`` runs both blocking.  ``"replicate"`` keeps whole copies.

Gradients: a parameter's gradient on a rank covers that rank's tokens only, and the loss is
normalised by the global number of targets, so gradients are summed over every rank that holds a
copy (``reduce_grads``; each sum is posted during backward by ``flashpar.models.grad_sync``): the norms
over the whole mesh, a tp shard without ZeRO-3 over the dp x cp x ulysses ranks of its tp index; ZeRO-3's
reduce-scatter over the shard group is that sum for its rows.

Mixed precision (``dtype=torch.bfloat16``): the parameters stay fp32; the activations are bf16 from the
embedding on, each layer casts its weight to bf16 for the GEMM (ZeRO-3: before the all-gather), the
norms and the loss compute in fp32, and every gradient is fp32 when it is summed across ranks
(``flashpar.models.precision``).  ``checkpoint_activations=True`` recomputes each block in backward
(``flashpar.models.recompute``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flashpar import cp
from flashpar.cp.layout import to_device
from flashpar.dims import DIMS, ParallelDims, head_layout
from flashpar.dist import all_gather_cat
from flashpar.mesh import model_groups
from flashpar.models.config import LlamaConfig
from flashpar.models.fused import rope_tables
from flashpar.models.grad_sync import GradSync
from flashpar.models.layout import LAYOUT, Piece, layout_of, padded_vocab, stack
from flashpar.models.llama import Llama, RMSNorm
from flashpar.models.precision import DTYPES, compute_dtype, widened
from flashpar.models.recompute import run_checkpointed
from flashpar.models.regions import Regions
from flashpar.models.regions import regions as regions_of
from flashpar.models.step_check import StepCheck
from flashpar.models.vocab import embed_rows, gathers_weight, own_rows_loss, vocab_parallel_loss
from flashpar.models.zero import all_gather_rows, gather_rows, keep_rows
from flashpar.models.zero_units import block_schedules, build_prefetcher
from flashpar.options import ParallelOptions
from flashpar.overlap.a2a import all_to_all_matmul, matmul_all_to_all
from flashpar.overlap.ops import all_gather_matmul
from flashpar.rows import row_sizes

MESH_DIMS = DIMS  # the mesh's dims, outermost first (a mesh without "ulysses": U = 1; flashpar.dims)


class GradTail(NamedTuple):
    """Gradients still in flight after ``ParallelLlama.reduce_grads(leave_tail=True)``: ``params`` and the
    call that lands them (``finish``)."""

    params: list[nn.Parameter]
    finish: Callable[[], None]


def ulysses_qkv_rows(cfg: LlamaConfig, n: int) -> list[int]:
    """Rows of ``w_qkv = cat(q, k, v)`` laid out by head group: ``[q_g; k_g; v_g]`` for ``g = 0..n-1``
    (``head_layout``: H / n query heads and max(H_kv / n, 1) kv heads per group; with H_kv < n kv head
    ``g // (n / H_kv)``, so a kv head appears in ``n / H_kv`` groups)."""
    hq, hk = head_layout(cfg.heads, cfg.kv_heads, n)
    d, k0, v0 = cfg.head_dim, cfg.heads * cfg.head_dim, (cfg.heads + cfg.kv_heads) * cfg.head_dim
    rows = []
    for g in range(n):
        kv = g * hk if cfg.kv_heads >= n else g // (n // cfg.kv_heads)
        q_rows = range(g * hq * d, (g + 1) * hq * d)
        kv_rows = range(kv * d, (kv + hk) * d)
        rows += [*q_rows, *(k0 + r for r in kv_rows), *(v0 + r for r in kv_rows)]
    return rows


class WholeProjection(nn.Module):
    """A projection weight ``[out, in]`` used whole (Ulysses: the GEMM fused with the all-to-all computes every
    head group's part of the rank's tokens); the block calls the fused op on it.  Without ZeRO-3 every rank
    holds it whole; with it the rank holds its rows (``keep_rows``) and ``source`` hands the whole weight,
    gathered ahead (q/k/v regrouped by head group)."""

    source = None

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features))  # filled by ParallelLlama.load_full

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, whole"


class Bias(nn.Module):
    """A bias vector of ``n`` entries as its own module (``LAYOUT``'s ``*_bias`` rows: split like its weight's rows
    over tp, or whole, but never over ZeRO-3's shard group); the block adds it to its projection's output."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(n))  # filled by ParallelLlama.load_full

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias.to(x.dtype)


def _bias(module: Bias | None) -> torch.Tensor | None:
    return None if module is None else module.bias


def _gain(norm: RMSNorm | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight


class ParallelBlock(nn.Module):
    """One decoder block on its groups, run with ``options`` (``ParallelLlama``'s): ``zero_group`` the shard group its
    weights' rows are kept over (ZeRO-3; None: whole tp shards), ``ulysses_group`` Ulysses' (None: tp splits the
    heads)."""

    def __init__(self, cfg: LlamaConfig, tp_group, cp_group, options: ParallelOptions, zero_group=None,
                 ulysses_group=None, window: int = 0) -> None:
        super().__init__()
        self.window = window or None  # this layer's sliding window (cp.attention's; None: the whole document)
        tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        u = dist.get_world_size(ulysses_group) if ulysses_group is not None else 1
        mode, timeout_s = options.mode, options.timeout
        self.options = options
        self.cfg, self.tp, self.cp_group, self.mode = cfg, tp, cp_group, mode
        self.ulysses_group = ulysses_group if u > 1 else None
        if self.ulysses_group is None:
            self.heads, self.kv_heads = cfg.heads // tp, cfg.kv_heads // tp
        else:
            self.heads, self.kv_heads = head_layout(cfg.heads, cfg.kv_heads, u)
        h, d = cfg.hidden, cfg.head_dim
        self.attn_norm = RMSNorm(h, cfg.norm_eps)
        kw = {"bias": False, "group": tp_group, "mode": mode, "timeout_s": timeout_s}
        self.timeout_s = timeout_s
        zero3 = zero_group is not None  # ZeRO-3: each rank keeps its rows of the tp shards over the shard group
        self.zero3 = zero3
        if zero3:
            kw["dp_group"] = zero_group
        # a column-parallel linear keeps its gathered input for backward (a fused ZeRO-3 linear gathers it again)
        gather_kw = {"save_gathered": options.save_gathered}
        qkv_rows = (cfg.heads + 2 * cfg.kv_heads) * d
        if self.ulysses_group is None:
            self.qkv = LAYOUT["qkv"].linear(zero3)(h, qkv_rows, **kw, **gather_kw)
            self.o_proj = LAYOUT["o_proj"].linear(zero3)(cfg.heads * d, h, **kw)
        else:  # whole weights (LAYOUT's ulysses_whole); q/k/v rows regrouped by head group per forward
            self.qkv, self.o_proj = WholeProjection(h, qkv_rows), WholeProjection(cfg.heads * d, h)
            self.register_buffer("qkv_rows", torch.tensor(ulysses_qkv_rows(cfg, u)), persistent=False)
            if zero3:
                keep_rows(self.qkv, zero_group)
                keep_rows(self.o_proj, zero_group)
        self.mlp_norm = RMSNorm(h, cfg.norm_eps)
        self.gate_up = LAYOUT["gate_up"].linear(zero3)(h, 2 * cfg.ffn, **kw, **gather_kw)
        self.down = LAYOUT["down"].linear(zero3)(cfg.ffn, h, **kw)
        # the family's vectors (flashpar.models.families): q/k/v biases of this rank's heads (Ulysses: all heads,
        # regrouped per forward like w_qkv), the FFN rows' gate/up biases, the output biases whole (added once,
        # after the reduce-scatter, to this rank's rows), the q/k norms whole (one weight per head_dim)
        self.qkv_bias = Bias(qkv_rows // (tp if self.ulysses_group is None else 1)) if cfg.qkv_bias else None
        self.o_bias = Bias(h) if cfg.o_bias else None
        self.gate_up_bias = Bias(2 * cfg.ffn // tp) if cfg.mlp_bias else None
        self.down_bias = Bias(h) if cfg.mlp_bias else None
        self.q_norm = RMSNorm(d, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.norm_eps) if cfg.qk_norm else None
        self.u_rank = dist.get_rank(ulysses_group) if self.ulysses_group is not None else 0
        self.kv_counter: cp.CommCounter | None = None  # set by ParallelLlama: K/V bytes of cp.attention
        # a forward-only caller (flashpar.infer's prefill) receives each forward's rotated K and V [T_cp, H_kv, D]
        self.kv_sink: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        # the elementwise work between the communicating ops, compiled with options.compile (models/regions.py)
        self.regions = regions_of(options.compile)

    def forward(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], plan, split: list[int],
                blocks: list[int]) -> torch.Tensor:
        """``x`` this rank's rows; ``split`` the tp ranks' rows of the ulysses rank's block, ``blocks`` the
        ulysses ranks' blocks of the cp rank's T_cp tokens (``tables``: the step's cos / sin tables of all T_cp
        of them, ``flashpar.models.fused.rope_tables``)."""
        o = self.attend(x, tables, plan, split, blocks)
        zkw = self._pick(plan)
        if self.ulysses_group is None:
            out = self.o_proj(o, split_sizes=split, check=False, **zkw)
        else:  # back to this rank's rows: head group g's columns of w_o are [g H/U D, (g + 1) H/U D)
            w_o = self.o_proj.source() if self.o_proj.source is not None else self.o_proj.weight.to(o.dtype)
            out = all_to_all_matmul(o, w_o, group=self.ulysses_group,
                                    mode=self.mode, split_sizes=blocks, check=False, timeout_s=self.timeout_s)
        x, m = self._add_norm(x, out)
        gu = self.gate_up(m, split_sizes=split, check=False, **zkw)
        out = self.down(self._swiglu(gu), split_sizes=split, check=False, **zkw)
        return self._add(x, out)

    # the regions as this block calls them (its weights and biases): forward's and warm_regions' one call each
    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.regions.norm(x, self.attn_norm.weight, self.attn_norm.eps)  # fp32 inside, out in x's dtype

    def _add_norm(self, x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.regions.add_norm(x, out, _bias(self.o_bias), self.mlp_norm.weight, self.mlp_norm.eps)

    def _swiglu(self, gu: torch.Tensor) -> torch.Tensor:
        return self.regions.swiglu(gu, _bias(self.gate_up_bias))

    def _add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self.regions.add(x, out, _bias(self.down_bias))

    def warm_regions(self, rows: int, dtype: torch.dtype, grad: bool) -> None:
        """Run each region once on ``rows`` rows of random inputs shaped and typed as ``forward``'s (with ``grad``:
        their backward too, into no ``.grad``; ``dtype`` the compute dtype), so that compiled regions compile here,
        not in a step."""
        cfg, device = self.cfg, self.attn_norm.weight.device
        h, d = cfg.hidden, cfg.head_dim
        qkv_cols = (self.heads + 2 * self.kv_heads) * d
        ffn = 2 * cfg.ffn // (self.tp if self.ulysses_group is None else 1)

        def rand(*shape):
            return torch.randn(*shape, dtype=dtype, device=device, requires_grad=grad)

        x, out, qkv, gu, y = rand(rows, h), rand(rows, h), rand(rows, qkv_cols), rand(rows, ffn), rand(rows, h)
        tables = tuple(torch.rand(rows, d // 2, dtype=dtype, device=device) for _ in range(2))
        with torch.set_grad_enabled(grad):
            outs = [self._norm(x), *self.heads_of(qkv, tables), *self._add_norm(x, out), self._swiglu(gu),
                    self._add(x, y)]
            if grad:
                torch.autograd.grad(sum(o.float().sum() for o in outs), [x, out, qkv, gu, y])

    def heads_of(self, qkv: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], regions: Regions | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, k, v`` of this rank's heads from the q/k/v GEMM's output ``qkv [T, (heads + 2 kv_heads) D]``: the
        bias added, q and k normed per head (``qk_norm``), rotated (``tables``): the ``heads`` region (of ``regions``;
        None: the block's)."""
        bias = _bias(self.qkv_bias)
        if bias is not None and self.ulysses_group is not None:  # this rank's head group of the regrouped rows
            n = qkv.shape[1]
            bias = bias.index_select(0, self.qkv_rows[self.u_rank * n : (self.u_rank + 1) * n])
        q_w, k_w = _gain(self.q_norm), _gain(self.k_norm)
        heads = (regions or self.regions).heads
        return heads(qkv, bias, q_w, k_w, *tables, self.heads, self.kv_heads, self.cfg.norm_eps)

    def _pick(self, plan) -> dict:
        """The ops' ``pick_rows`` (ZeRO-3): with ``check=False`` each rank picks mode auto's schedules itself, and a
        fused ZeRO-3 linear's shard group spans cp ranks holding different token counts, so it picks on the
        sequence's tokens over cp, the same number on every rank of it (the rows the simulator picks on)."""
        return {"pick_rows": max(plan.total_tokens // plan.cp_size, 1)} if self.zero3 else {}

    def attend(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], plan, split: list[int],
               blocks: list[int], rows: tuple[int, ...] | None = None) -> torch.Tensor:
        """The block's attention output ``[T_cp, heads * D]`` (every token of the cp rank, this rank's heads),
        before ``o_proj``; the arguments are ``forward``'s.  ``rows``: only these local rows computed, the others
        zero (``cp.attention``'s ``rows``)."""
        t = tables[0].shape[0]
        a = self._norm(x)
        # check=False on every op: ParallelLlama.forward checked this step's inputs across ranks once
        # (models/step_check.py)
        if self.ulysses_group is None:  # every token of the cp rank, this tp rank's heads
            qkv = self.qkv(a, split_sizes=split, check=False, **self._pick(plan))
        else:  # every token of the cp rank, this ulysses rank's head group
            if self.qkv.source is not None:  # ZeRO-3: gathered ahead, already regrouped, in the compute dtype
                w_qkv = self.qkv.source()
            else:
                w_qkv = self.qkv.weight.index_select(0, self.qkv_rows).to(a.dtype)  # regrouped, then cast
            qkv = matmul_all_to_all(a, w_qkv, group=self.ulysses_group, mode=self.mode, split_sizes=blocks,
                                    check=False, timeout_s=self.timeout_s)
        q, k, v = self.heads_of(qkv, tables)
        if self.kv_sink is not None:
            self.kv_sink(k, v)
        backend = None if self.options.attention_backend == "auto" else self.options.attention_backend
        return cp.attention(q, k, v, plan, group=self.cp_group, counter=self.kv_counter, timeout_s=self.timeout_s,
                            check=False, rows=rows, backend=backend, window=self.window
                            ).reshape(t, self.heads * self.cfg.head_dim)


class ParallelLlama(nn.Module):
    """The decoder on a mesh with dims ``MESH_DIMS = ("dp", "cp", "ulysses", "tp")`` (any of them may have size
    1; a mesh without ``"ulysses"`` is one with U = 1).  Ulysses and tensor parallelism both split the heads:
    ulysses > 1 needs tp = 1.

    How it runs is ``options`` (``flashpar.options.ParallelOptions``; none given: its defaults, with any of its
    fields given by name in ``settings`` changed, e.g. ``ParallelLlama(cfg, mesh, mode="auto", dp_mode="replicate")``):

    * ``dtype``: the compute dtype (``"fp32"`` or ``"bf16"``; the parameters stay fp32, see
      ``flashpar.models.precision``); ``checkpoint_activations``: recompute each block's activations in backward
      (``flashpar.models.recompute``).
    * ``regather``: each tensor-parallel all-gather + GEMM (q/k/v, gate/up, the head) gathers ``x_shard [T/tp, in]``
      again in backward (Megatron's choice) instead of keeping the gathered ``x [T, in]`` for its weight gradient,
      as torch's DTensor linear does (the default): one all-gather more per column-parallel linear and step, for
      ``(tp - 1) / tp x T x in`` less activation memory each.  A fused ZeRO-3 linear gathers again either way
      (``flashpar.overlap.sharded``).
    * ``gather_vocab``: where the vocabulary is smaller than the cp (ulysses) rank's tokens, the tp ranks all-gather
      the embedding and head weights and compute their own rows whole, instead of moving the activations
      (``flashpar.models.vocab``); False keeps the activation path always.
    * ZeRO-3 (``dp_mode="zero3"`` over a shard group of more than one rank: ``flashpar.models.zero_units``):
      ``zero_schedule`` is ``"prefetch"`` or ``"fused"`` for every block, or one per block; ``prefetch``: the units
      gathered ahead of the one computing (``mode="none"``: 0, blocking); ``zero_collective``: how the units
      travel, ``"ring"`` (the backend's all-gather / reduce-scatter) or ``"doubling"`` (``ceil(log2 n)``
      point-to-point steps, ``flashpar.overlap.doubling``).  ``auto`` for either is chosen before the model is
      built (``flashpar.train.planning.resolve_options``), not here.
    """

    def __init__(self, cfg: LlamaConfig, mesh, options: ParallelOptions | None = None, **settings) -> None:
        super().__init__()
        options = options or ParallelOptions()
        if settings:
            options = options.replace(**settings)  # unknown names: TypeError; bad values: one line
        if not options.resolved:
            raise ValueError(f"ParallelLlama: zero_schedule {options.zero_schedule!r} / zero_collective "
                             f"{options.zero_collective!r}: 'auto' is chosen before the model is built "
                             "(flashpar.train.planning.resolve_options); give the choice")
        self.options = options
        mode, dp_mode, timeout_s = options.mode, options.dp_mode, options.timeout
        self.save_gathered = options.save_gathered
        self.compute_dtype = compute_dtype(DTYPES[options.dtype])
        self.checkpoint_activations = options.checkpoint_activations
        self.cfg, self.mesh = cfg, mesh
        self.dims = dims = ParallelDims.of_mesh(mesh)  # (a mesh without "ulysses": U = 1)
        dims.check(cfg, mode, where="ParallelLlama: ")
        self.dp, self.dp_rank = dims.dp, mesh["dp"].get_local_rank()
        self.tp_group, self.cp_group = mesh["tp"].get_group(), mesh["cp"].get_group()
        self.tp, self.tp_rank = dims.tp, mesh["tp"].get_local_rank()
        self.cp_rank = mesh["cp"].get_local_rank()
        has_u = "ulysses" in (mesh.mesh_dim_names or ())
        self.ulysses, self.u_rank = dims.ulysses, (mesh["ulysses"].get_local_rank() if has_u else 0)
        ulysses_group = mesh["ulysses"].get_group() if self.ulysses > 1 else None
        # ZeRO-3 over the shard group: the dp x cp x ulysses ranks of this tp index (flashpar.models.zero_units)
        self.shard_size = dims.shard_size
        self.zero = dp_mode == "zero3" and self.shard_size > 1
        schedules = (block_schedules(options.zero_schedule, cfg.layers, self.ulysses) if self.zero
                     else [None] * cfg.layers)
        self.zero_schedule = schedules
        groups = model_groups(mesh, zero=self.zero, fused="fused" in schedules)  # all of them, one fixed order
        # the vocabulary padded to a multiple of tp (layout.VocabRows): rows past vocab_size are zeros, their
        # logits masked out of the loss (models/vocab.py) and of generation
        self.vocab_rows = padded_vocab(cfg.vocab_size, self.tp)
        self.mode, self.vocab_lo = mode, self.tp_rank * self.vocab_rows // self.tp
        self.embed = nn.Embedding(self.vocab_rows // self.tp, cfg.hidden)  # this tp rank's vocabulary rows
        windows = cfg.windows or (0,) * cfg.layers
        self.blocks = nn.ModuleList(
            ParallelBlock(cfg, self.tp_group, self.cp_group, options,
                          groups.fused if schedule == "fused" else groups.gather, ulysses_group, window)
            for schedule, window in zip(schedules, windows, strict=True))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.regions = regions_of(options.compile)  # the last norm's (each block holds its own reference)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden, self.vocab_rows // self.tp, bias=False)
        self.prefetcher, self.units = None, {}
        self.grad_tail: GradTail | None = None  # set by flashpar.train.step between backward and the norm
        if self.zero:  # the vocabulary rows too; the units gathered ahead, 0 ahead (blocking) in mode none
            keep_rows(self.embed, groups.gather)
            if self.head is not None:
                keep_rows(self.head, groups.gather)
            self.prefetcher = build_prefetcher(self, schedules, groups, 0 if mode == "none" else options.prefetch,
                                               timeout_s, options.zero_collective)
        self._sum_groups = {"shard": groups.shard, "copy": groups.copy}
        self.grad_sync = GradSync([(p, self._sum_groups[kind]) for name, p in reversed(list(self.named_parameters()))
                                   if (kind := layout_of(name)[0].grad_sum(self.zero)) != "zero"], timeout_s=timeout_s)
        signature = (cfg, options.replace(zero_schedule=tuple(s or "prefetch" for s in schedules)),
                     tuple(mesh.mesh.shape), mesh.mesh_dim_names)
        self.step_check = StepCheck(mesh, signature, timeout_s=timeout_s)  # the cross-rank check of each step's inputs
        self.kv_counter = cp.CommCounter()  # bytes this rank's attention sent and received, all layers
        self.kv_recompute = cp.CommCounter()  # the same, of the recomputed forwards (checkpoint_activations)
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
        _, names = layout_of(name)
        return stack(self.pieces_of(name, [full[n].shape for n in names]), lambda p: p.of(full[names[p.part]]))

    def pieces_of(self, name: str, shapes: list[tuple[int, ...]]) -> list[Piece]:
        """The index ranges of the single-process tensors (``shapes``: those of ``layout_of(name)``'s names) that
        this rank's parameter ``name`` holds: its tp shard, with ZeRO-3 its rows of it (``LAYOUT``)."""
        layout, _ = layout_of(name)
        rows = (dist.get_rank(self._sum_groups["shard"]), self.shard_size) if layout.zero_rows(self.zero) else None
        return layout.pieces(shapes, self.tp_rank, self.tp, rows)

    def load_hf_slices(self, path) -> int:
        """Take this rank's shards from a Hugging Face folder, reading only the slices this rank holds
        (``pieces_of``; ``flashpar.models.hf.WeightFiles``).  The folder's config must be this model's
        (``ValueError``, one line, before anything is read).  Returns the bytes this rank read."""
        from flashpar.models.hf import WeightFiles

        with WeightFiles(path, self.cfg) as files, torch.no_grad():
            for name, p in self.named_parameters():
                _, names = layout_of(name)
                pieces = self.pieces_of(name, [files.shape(n) for n in names])
                p.copy_(stack(pieces, lambda piece, names=names: files.read(names[piece.part], piece)))
            return files.bytes_read

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
            if layout.zero_rows(self.zero):  # the shard group's rows first: the whole tp shard
                rows = modules[name.rsplit(".", 1)[0]].total_rows
                with torch.no_grad():
                    g = gather_rows(g.detach(), self._sum_groups["shard"], rows)
            out.update(zip(names, layout.unshard(g, self._gather_tp, self.cfg, self.tp), strict=True))
        return out

    def _gather_tp(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.clone() if self.tp == 1 else all_gather_cat(x, self.tp_group, self.tp, dim)

    def sum_grads_in_backward(self) -> None:
        """Post each gradient's sum during the next backward, as soon as the gradient is complete
        (``flashpar.models.grad_sync``); ``reduce_grads`` then waits for them."""
        self.grad_sync.arm()

    def reduce_grads(self, *, leave_tail: bool = False) -> GradTail:
        """Sum every gradient over the ranks that hold a copy of its parameter (see the module docstring):
        the sums ``sum_grads_in_backward`` posted during backward, and the rest; with ZeRO-3 the units'
        reduce-scatters land their rows' gradients.  ``leave_tail``: the reduce-scatter posted last (the
        embedding's, whose gradient is complete only at the end of backward) is left in flight: the returned
        ``GradTail`` names its parameters and lands them (``finish``), so the caller can work on the others
        meanwhile (``flashpar.models.grad_norm``: their squares)."""
        self.grad_sync.finish()
        if self.prefetcher is None:
            return GradTail([], lambda: None)
        tail = self.prefetcher.finish(leave_last=leave_tail)
        return GradTail(tail, self.prefetcher.finish_tail)

    # ------------------------------------------------------------------------------------------
    # forward

    def check_step(self, inputs, count: float) -> None:
        """The cross-rank check of a step of several micro-batches (``[(tokens_cp, labels_cp, plan), ...]``), one
        exchange for all; their forwards then pass ``checked=True``."""
        self.step_check.many(inputs, count, self.embed.weight, auto=self.mode == "auto")

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The last norm's region as forward and warm_regions call it."""
        return self.regions.norm(x, self.norm.weight, self.norm.eps)

    def warm_regions(self, *, grad: bool = True, rows: int = 11) -> None:
        """Compile the regions (``options.compile``) before the first step: every block's and the last norm's, run
        once on ``rows`` random rows (``ParallelBlock.warm_regions``; a prime: no size of the model is equal to it,
        so the dynamic-shape graphs assume no equality that a step's token count could break).  Every block
        calls the same regions, so the first block's calls compile them for all.  With ``grad`` (training) the
        loss's ``loss_sums`` too, at each width a step can take: this rank's vocabulary columns, and the whole
        vocabulary where the tp ranks may gather it (``gathers_weight``, chosen per step by the token count)."""
        self.blocks[0].warm_regions(rows, self.compute_dtype, grad)
        device = self.norm.weight.device
        x = torch.randn(rows, self.cfg.hidden, dtype=self.compute_dtype, device=device, requires_grad=grad)
        with torch.set_grad_enabled(grad):
            y = self._final_norm(x)
            if not grad:
                return
            torch.autograd.grad(y.float().sum(), [x])
            widths = {self.vocab_rows // self.tp} | ({self.vocab_rows} if self.options.gather_vocab else set())
            for width in sorted(widths):
                logits = torch.randn(rows, width, device=device, requires_grad=True)  # fp32: the loss widens
                index = torch.randint(0, width, (rows,), device=device)
                total, picked = self.regions.loss_sums(logits, logits.detach().amax(-1), index, index >= 0)
                torch.autograd.grad((total + picked).sum(), [logits])

    def embed_tokens(self, tokens_u: torch.Tensor, rows: slice, embed_t: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This tp rank's ``rows`` of the embedding of ``tokens_u`` (all the tp ranks' tokens), in the compute
        dtype, from this tp rank's vocabulary rows ``embed_t``; and the whole table where it was gathered (a
        vocabulary smaller than the tokens, ``flashpar.models.vocab``: the weight moves, not the activations;
        gathered in fp32 so that its gradient sums in fp32), else None."""
        vocab, dtype = self.cfg.vocab_size, self.compute_dtype
        if self.options.gather_vocab and gathers_weight(vocab, tokens_u.shape[0], self.tp):
            embed = all_gather_rows(widened(embed_t), self.tp_group, self.vocab_rows)
            return F.embedding(tokens_u[rows], embed).to(dtype), embed
        return embed_rows(tokens_u, embed_t, self.vocab_lo, self.tp_group, dtype=dtype), None

    def forward(self, tokens_cp: torch.Tensor, plan, labels_cp: torch.Tensor, count: float, *,
                checked: bool = False) -> torch.Tensor:
        """This rank's share of the loss: ``tokens_cp`` / ``labels_cp`` are the cp rank's tokens and targets
        (``cp.shard(x, plan, cp_rank)``), ``count`` the global batch's number of targets; the shares of all
        ranks add up to the mean next-token loss.  Every rank raises (one line) on bad or disagreeing inputs,
        checked once here (or, ``checked``, by ``check_step`` for the step's micro-batches together); the layers'
        ops run unchecked (``flashpar.models.step_check``)."""
        if not checked:
            self.step_check(tokens_cp, labels_cp, plan, count, self.embed.weight, auto=self.mode == "auto")
        blocks = row_sizes(tokens_cp.shape[0], self.ulysses)  # the ulysses ranks' rows (U = 1: all of them)
        lo = sum(blocks[: self.u_rank])
        tokens_u, labels_u = tokens_cp[lo : lo + blocks[self.u_rank]], labels_cp[lo : lo + blocks[self.u_rank]]
        split = row_sizes(tokens_u.shape[0], self.tp)  # the tp ranks' rows of them
        start = sum(split[: self.tp_rank])
        rows = slice(start, start + split[self.tp_rank])
        # all T_cp positions (attention sees every token of the cp rank), copied without a host wait on CUDA
        positions = to_device(plan.position_ids(self.cp_rank), tokens_cp.device)
        dtype = self.compute_dtype  # fp32: every cast below returns its input itself
        tables = rope_tables(positions, self.cfg, dtype)  # rope's cos / sin: once per step, for every layer
        vocab = self.cfg.vocab_size
        pf, units = self.prefetcher, self.units
        if pf is not None:
            pf.begin()
        # this tp rank's vocabulary rows: the parameter (fp32), or under ZeRO-3 the gathered unit (compute dtype)
        embed_t = pf.enter(units["embed"])[0] if pf is not None else self.embed.weight
        x, embed = self.embed_tokens(tokens_u, rows, embed_t)
        whole = embed is not None
        if pf is not None:
            x = pf.exit(units["embed"], x)
        for i, block in enumerate(self.blocks):
            k = units["blocks"][i] if pf is not None else None
            if k is not None:
                pf.enter(k)  # waits for the block's weights, posts the next units' gathers
            if self.checkpoint_activations:
                x = run_checkpointed(block, self.kv_recompute, x, tables, plan, split, blocks)
            else:
                with pf.saving(k) if k is not None else contextlib.nullcontext():
                    x = block(x, tables, plan, split, blocks)
            if k is not None:
                x = pf.exit(k, x)
        head_t = embed_t  # tied: the embedding's rows (its unit kept gathered from the start of forward)
        if self.head is not None:
            head_t = pf.enter(units["head"])[0] if pf is not None else self.head.weight
        x = self._final_norm(x)
        if whole:
            head = embed if self.head is None else all_gather_rows(widened(head_t), self.tp_group, self.vocab_rows)
            loss = own_rows_loss(x.to(dtype), head.to(dtype), labels_u[rows], count, vocab, self.regions)
        else:
            logits = all_gather_matmul(x.to(dtype), head_t.to(dtype), None, group=self.tp_group,
                                       mode=self.mode, split_sizes=split, save_gathered=self.save_gathered,
                                       check=False)
            loss = vocab_parallel_loss(logits, labels_u, self.vocab_lo, self.tp_group, rows, count, vocab,
                                       self.regions)
        if pf is not None and self.head is not None:
            loss = pf.exit(units["head"], loss)
        return loss

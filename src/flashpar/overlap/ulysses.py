"""Ulysses sequence-parallel attention with both all-to-alls fused into the projections around it.

    x_shard [s_r, hidden]                                    this rank's contiguous tokens
      -> qkv [S, (hq + 2 hk) D] = matmul_all_to_all(x_shard)  every token, head group r
      -> causal attention of the hq query heads (hk kv heads) over the whole sequence
      -> y_shard [s_r, hidden] = all_to_all_matmul(o)         back to this rank's tokens

With ``N`` ranks, rank ``r`` attends with query heads ``[r hq, (r + 1) hq)`` (``hq = heads / N``).
Key/value heads: ``kv_heads >= N`` gives each rank ``hk = kv_heads / N`` of them (grouped-query
attention as usual, ``kv_heads`` divisible by ``N``); ``kv_heads < N`` replicates each kv head on
``N / kv_heads`` ranks (``hk = 1``), the only layout in which every rank holds the kv head its
query heads read.  The fused QKV weight is laid out by head group on the fly (rows of the q, k
and v projections for group ``r``, concatenated), so the parameters keep the usual shapes
``q_proj [heads D, hidden]``, ``k_proj`` / ``v_proj [kv_heads D, hidden]``, ``o_proj [hidden, heads D]``.

Rotary embeddings: pass ``position_ids`` (for the whole sequence ``[S]``, or this rank's tokens
``[s_r]``, which are then all-gathered: a few bytes) and they are applied to q and k after the
all-to-all; without ``position_ids`` no rotary embedding is applied.

Weights are replicated over the group.  ``reduce_grads=True`` (default) all-reduces their
gradients (sum over the group) inside the backward, so each rank holds the gradient of the whole
sequence, as the unsharded layer would.  Pass ``False`` where a data-parallel wrapper already
reduces over a group that contains this one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashpar.dist import DEFAULT_TIMEOUT_S, all_gather_single, as_timedelta, resolve_group
from flashpar.overlap.a2a import all_to_all_matmul, matmul_all_to_all


def head_layout(heads: int, kv_heads: int, n: int) -> tuple[int, int]:
    """(query heads, kv heads) per rank; raises a clear error for layouts Ulysses cannot shard."""
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"heads = {heads} must be a positive multiple of kv_heads = {kv_heads}")
    if heads % n:
        raise ValueError(f"heads = {heads} is not divisible by the sequence-parallel size {n}")
    if kv_heads >= n and kv_heads % n:
        raise ValueError(f"kv_heads = {kv_heads} is not divisible by the sequence-parallel size {n}")
    if kv_heads < n and n % kv_heads:
        raise ValueError(f"kv_heads = {kv_heads} < {n} ranks must divide {n} (each kv head replicated on "
                         f"{n} / kv_heads ranks)")
    return heads // n, max(kv_heads // n, 1)


def default_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """Plain rope's frequencies ``f_i = theta^(-2i / D)``, ``i < D / 2`` (float64); a model's, with its
    rope scaling: ``flashpar.models.rope.inverse_frequencies``."""
    return theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the angles ``positions [S] x inv_freq [D/2]`` (``[S, D/2]``), computed in float64 and
    returned in ``dtype``."""
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float | None = None, *,
           inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary embedding (Llama's half-split form) of ``x [..., S, D]`` at ``positions [S]``:
    ``x cos(p f) + rotate_half(x) sin(p f)``, with the frequencies ``inv_freq [D/2]`` when given (a model's:
    ``flashpar.models.rope``), else ``f_i = theta^(-2i / D)``."""
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {d}")
    if inv_freq is None:
        if theta is None:
            raise ValueError("rotate: pass theta or inv_freq")
        inv_freq = default_frequencies(d, theta, x.device)
    elif inv_freq.shape != (d // 2,):
        raise ValueError(f"rotate: inv_freq has shape {tuple(inv_freq.shape)}, expected ({d // 2},)")
    cos, sin = rotary_tables(positions, inv_freq, x.dtype)  # inv_freq on x's device
    cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + half * sin


class UlyssesAttention(nn.Module):
    """Causal multi-head (GQA) attention over a sequence sharded on ``group``, Ulysses style.

    ``forward(x_shard [s_r, hidden], position_ids=None, split_sizes=None) -> [s_r, hidden]``.
    ``mode``: flash | slice | none | auto for both fused all-to-alls.
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int, *, group=None, mode: str = "flash",
                 bias: bool = False, head_dim: int | None = None, chunks: int | None = None,
                 rope_theta: float = 10000.0, reduce_grads: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S,
                 device=None, dtype=None) -> None:
        super().__init__()
        info = resolve_group(group)
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"hidden = {hidden} is not divisible by heads = {heads}; pass head_dim=")
            head_dim = hidden // heads
        self.hq, self.hk = head_layout(heads, kv_heads, info.world_size)
        self.hidden, self.heads, self.kv_heads, self.head_dim = hidden, heads, kv_heads, head_dim
        self.group, self.mode, self.chunks, self.timeout_s = group, mode, chunks, timeout_s
        self.rope_theta, self.reduce_grads = rope_theta, reduce_grads
        self.sp_size, self.sp_rank = info.world_size, info.rank
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.q_proj = nn.Linear(hidden, heads * head_dim, **kw)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, **kw)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, **kw)
        self.o_proj = nn.Linear(heads * head_dim, hidden, **kw)

    @classmethod
    def from_linears(cls, q_proj: nn.Linear, k_proj: nn.Linear, v_proj: nn.Linear, o_proj: nn.Linear, heads: int,
                     kv_heads: int, *, group=None, mode: str = "flash", **kwargs) -> UlyssesAttention:
        """The same attention from full (unsharded) projections; every rank passes the same weights."""
        head_dim = q_proj.out_features // heads
        if q_proj.out_features != heads * head_dim or k_proj.out_features != kv_heads * head_dim:
            raise ValueError(f"projections q {tuple(q_proj.weight.shape)}, k {tuple(k_proj.weight.shape)} do not fit "
                             f"heads = {heads}, kv_heads = {kv_heads}")
        mod = cls(q_proj.in_features, heads, kv_heads, group=group, mode=mode, bias=q_proj.bias is not None,
                  head_dim=head_dim, device=q_proj.weight.device, dtype=q_proj.weight.dtype, **kwargs)
        with torch.no_grad():
            for mine, theirs in ((mod.q_proj, q_proj), (mod.k_proj, k_proj), (mod.v_proj, v_proj),
                                 (mod.o_proj, o_proj)):
                mine.weight.copy_(theirs.weight)
                if mine.bias is not None:
                    mine.bias.copy_(theirs.bias)
        return mod

    def _kv_rows(self, g: int) -> slice:
        first = g * self.hk if self.kv_heads >= self.sp_size else g // (self.sp_size // self.kv_heads)
        return slice(first * self.head_dim, (first + self.hk) * self.head_dim)

    def _grouped(self, which: str) -> torch.Tensor | None:
        """The fused QKV weight (or bias), rows laid out by head group: [q_g; k_g; v_g] for g = 0..N-1."""
        q, k, v = (getattr(getattr(self, f"{p}_proj"), which) for p in "qkv")
        if q is None:
            return None
        rows = self.hq * self.head_dim
        parts = []
        for g in range(self.sp_size):
            kv = self._kv_rows(g)
            parts += [q[g * rows : (g + 1) * rows], k[kv], v[kv]]
        return torch.cat(parts)

    def forward(self, x_shard: torch.Tensor, position_ids: torch.Tensor | None = None,
                split_sizes: list[int] | None = None) -> torch.Tensor:
        kw = {"group": self.group, "mode": self.mode, "chunks": self.chunks, "split_sizes": split_sizes,
              "reduce_weight_grad": self.reduce_grads, "timeout_s": self.timeout_s}
        if x_shard.dim() != 2 or x_shard.shape[-1] != self.hidden:
            raise ValueError(f"UlyssesAttention: x_shard must be [tokens, {self.hidden}], got {tuple(x_shard.shape)}")
        qkv = matmul_all_to_all(x_shard, self._grouped("weight"), self._grouped("bias"), **kw)
        s_total, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.hq * d, self.hk * d, self.hk * d], dim=-1)
        q, k, v = (t.reshape(s_total, -1, d).transpose(0, 1) for t in (q, k, v))  # [heads, S, D]
        if position_ids is not None:
            positions = self._full_positions(position_ids, x_shard.shape[0], s_total)
            q, k = rotate(q, positions, self.rope_theta), rotate(k, positions, self.rope_theta)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.hq != self.hk)
        o = o.transpose(0, 1).reshape(s_total, self.hq * d)
        return all_to_all_matmul(o, self.o_proj.weight, self.o_proj.bias, **kw)

    def _full_positions(self, position_ids: torch.Tensor, s_local: int, s_total: int) -> torch.Tensor:
        """Position ids of every token: given whole (``[S]``), or this rank's ``[s_r]``, all-gathered."""
        position_ids = position_ids.reshape(-1)
        if position_ids.numel() == s_total:
            return position_ids
        if position_ids.numel() != s_local:
            raise ValueError(f"UlyssesAttention: position_ids has {position_ids.numel()} entries; expected this "
                             f"rank's {s_local} tokens or the sequence's {s_total}")
        info = resolve_group(self.group)
        mine = torch.zeros(s_total + 1, dtype=torch.int64, device=position_ids.device)
        mine[0], mine[1 : 1 + s_local] = s_local, position_ids
        table = torch.empty(info.world_size * (s_total + 1), dtype=torch.int64, device=position_ids.device)
        work = all_gather_single(table, mine, group=info.group, async_op=True)
        work.wait(as_timedelta(self.timeout_s))
        table = table.view(info.world_size, s_total + 1)
        return torch.cat([table[j, 1 : 1 + int(table[j, 0])] for j in range(info.world_size)])

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, heads={self.heads}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
                f"sp={self.sp_size} ({self.hq} q / {self.hk} kv heads per rank), mode={self.mode}")

"""A block's elementwise work on one rank: the bytes its kernels move (at memory bandwidth) and their launches,
for what each side runs.

Which count a configuration gets (``compiled``: ``Workload.flashpar_compiled`` for flashpar and baseline, whose
blocks flashpar's executor runs; ``Workload.torch_compiled`` for the torch peers)::

    flashpar, eager      flashpar's model as it runs without --compile (flashpar.models.parallel, .llama,
                         .fused): RMSNorm op by op, residual and bias adds, rope and SwiGLU
                         as one autograd node each                                  flashpar_eager_bytes
    flashpar, compiled   ``flashpar train --compile``: each block's elementwise regions (RMSNorm, the
                         residual add with the norm after it, q/k bias + qk-norm + rope, SwiGLU + bias)
                         compiled by inductor, the communicating ops eager           fused_bytes
    torch, eager         torchtitan's Llama without torch.compile                    torch_eager_bytes
    torch, compiled      torchtitan's Llama under torch.compile                      fused_bytes

Every count is of one block's forward at the mean rows; backward moves twice the bytes (``elementwise``).
"""

from __future__ import annotations

from flashpar.cost import Hardware
from flashpar.sim.parts import Part
from flashpar.sim.peers import Peer, is_torch
from flashpar.sim.workload import Workload

KERNELS_PER_BLOCK = (16, 32)
"""Kernel launches of a block besides its GEMMs and attention, forward and backward, each costing the device's
``gemm_overhead_s``: the figure of a compiled block (either side) and of torchtitan's eager one.  It is the figure
the ``h100-96gb`` preset's clock was fitted with (``flashpar.sim.anchors``, an eager torch run), so it stays one
figure for those three: a compiled block launches fewer (about one per compiled region, 4 or 5), torchtitan's
eager one more (about 29); on an 8B model that is a few milliseconds of a step of seconds.  flashpar's eager
block gets its own kernels' count (``flashpar_eager_kernels``)."""


def label(both_compiled: bool) -> str:
    """The line a command prints to say how both sides run their elementwise work."""
    if both_compiled:
        return ("elementwise: compiled on both sides (torch.compile; flashpar's figures are those of `flashpar "
                "train --compile`)")
    return "elementwise: eager on both sides (no torch.compile; flashpar's own kernels, torchtitan's)"


def compiled(w: Workload, peer: Peer) -> bool:
    """Whether ``peer``'s blocks run their elementwise regions compiled in ``w``."""
    return w.torch_compiled if is_torch(peer) else w.flashpar_compiled


def _rows(w: Workload, peer: Peer) -> tuple[dict, float, float, float, float]:
    """(sizes, rows of the sequence-parallel ``hidden`` tensors, q + k elements per block, v elements, SwiGLU's
    ``F / tp`` elements)."""
    cfg, s = w.cfg, w.sizes(peer)
    d = cfg.head_dim
    return (s, s["t_u"] / s["tp"], (s["heads"] + s["kv_heads"]) * d * s["t_cp"], s["kv_heads"] * d * s["t_cp"],
            cfg.ffn / s["tp"] * s["t_u"])


def fused_bytes(w: Workload, peer: Peer) -> float:
    """Fused (a compiled block; the fewest passes each op needs), in elements of the compute dtype ``e``: two
    RMSNorms and two residual adds on the ``T_u / tp`` sequence-parallel rows of ``hidden`` (3 passes each), rope
    on q and k (3 passes), SwiGLU's silu(g) u on ``T_u`` rows of ``ffn / tp`` (5 passes)."""
    e, cfg = w.elem_bytes, w.cfg
    s, rows_sp, qk, _, _ = _rows(w, peer)
    residual = 2 * 3 * e * cfg.hidden * rows_sp
    return 2 * 3 * e * cfg.hidden * rows_sp + residual + 3 * e * qk + 5 * e * cfg.ffn / s["tp"] * s["t_u"]


def torch_eager_bytes(w: Workload, peer: Peer) -> float:
    """torchtitan's Llama without torch.compile: per element, each kernel's reads and writes, fp32 where the model
    casts: RMSNorm ``x.float()``, ``pow``, ``mean``, ``x * rsqrt``, ``type_as``, ``* weight`` = 28 + 4 e bytes;
    rope's ``float()``, complex multiply, ``type_as`` = 16 + 2 e; ``repeat_kv``'s copies of k and v to every query
    head, 2 e (H + H_kv) d per token (when H_kv < H); the attention output's ``transpose().contiguous()``, 2 e H d;
    residual adds and SwiGLU as ``fused_bytes``."""
    e, cfg = w.elem_bytes, w.cfg
    s, rows_sp, qk, _, _ = _rows(w, peer)
    norms = 2 * (28 + 4 * e) * cfg.hidden * rows_sp
    residual = 2 * 3 * e * cfg.hidden * rows_sp
    rope = (16 + 2 * e) * qk
    repeat = 2 * e * qk if s["kv_heads"] < s["heads"] else 0.0
    out = 2 * e * s["heads"] * cfg.head_dim * s["t_cp"]
    return norms + residual + rope + repeat + out + 5 * e * cfg.ffn / s["tp"] * s["t_u"]


def norm_bytes(e: int) -> int:
    """Bytes per element of flashpar's eager RMSNorm (``flashpar.models.llama.RMSNorm``) on a tensor of the compute
    dtype (``e`` bytes) with its fp32 weight, the block's cast back included: ``x.to(fp32)`` e + 4, ``pow(2)`` 8,
    ``mean`` 4, ``wide * r`` 8, ``.to(dtype)`` 4 + e, ``* weight`` (fp32 out) e + 4, the caller's ``.to(dtype)``
    4 + e (``+ eps`` and ``rsqrt`` act on one value per row); 36 + 4 e, and 28 in fp32, where the casts are no-ops."""
    cast = 0 if e == 4 else e + 4
    return cast + 8 + 4 + 8 + cast + (e + 4) + cast


def norm_kernels(e: int) -> int:
    """Launches of that RMSNorm: ``pow``, ``mean``, ``+ eps``, ``rsqrt``, ``wide * r``, ``* weight``, and the
    three casts where the compute dtype is not fp32."""
    return 6 + (0 if e == 4 else 3)


def flashpar_eager_bytes(w: Workload, peer: Peer) -> float:
    """flashpar's block without --compile (``flashpar.models.parallel.ParallelBlock``), per element each kernel's
    reads and writes:

    * two RMSNorms on the ``T_u / tp`` rows of ``hidden``, ``norm_bytes`` each (36 + 4 e; 28 in fp32);
    * two residual adds ``x + out``, 3 e;
    * ``rope_qkv`` (``flashpar.models.fused``): q and k rotated half by half, each half a ``mul`` into the output
      (read, write) and an ``addcmul_`` on it (read the output and the other half, write): 5 e per q and k
      element; v copied out of the q/k/v GEMM's output, 2 e per element (the cos / sin tables are read once per
      token, not per head: left out);
    * ``swiglu``: ``silu(g)`` (read g, write silu(g), which backward keeps) and ``silu(g) * u``: 5 e per element;
    * the family's extras (``LlamaConfig``): a bias add (``qkv_bias``, ``o_bias``, ``mlp_bias``'s gate/up and
      down) 2 e per element of its output; ``qk_norm``: an RMSNorm of every q and k element (``norm_bytes``) and
      the ``torch.cat`` of q, k, v back into one tensor, 2 e per element."""
    cfg, e = w.cfg, w.elem_bytes
    _, rows_sp, qk, v, ffn = _rows(w, peer)
    rows_h = cfg.hidden * rows_sp
    out = 2 * norm_bytes(e) * rows_h + 2 * 3 * e * rows_h + 5 * e * qk + 2 * e * v + 5 * e * ffn
    out += cfg.qkv_bias * 2 * e * (qk + v) + cfg.o_bias * 2 * e * rows_h
    out += cfg.mlp_bias * 2 * e * (2 * ffn + rows_h)
    out += cfg.qk_norm * (norm_bytes(e) * qk + 2 * e * (qk + v))
    return out


def flashpar_eager_kernels(w: Workload) -> int:
    """Forward launches of flashpar's eager block (``flashpar_eager_bytes``'s kernels): two RMSNorms
    (``norm_kernels``), two residual adds, ``rope_qkv``'s four per q and k and v's copy (9), SwiGLU's two; a bias
    add two (the bias's cast and the add), qk-norm two RMSNorms and the ``cat``."""
    cfg, e = w.cfg, w.elem_bytes
    n = 2 * norm_kernels(e) + 2 + 9 + 2
    n += 2 * (cfg.qkv_bias + cfg.o_bias + 2 * cfg.mlp_bias) + cfg.qk_norm * (2 * norm_kernels(e) + 1)
    return n


def elementwise_bytes(w: Workload, peer: Peer) -> float:
    """Bytes one block's forward elementwise work moves on a rank, at the mean rows: ``fused_bytes`` where
    ``peer``'s blocks run compiled, else its own eager count (``flashpar_eager_bytes`` or ``torch_eager_bytes``)."""
    if compiled(w, peer):
        return fused_bytes(w, peer)
    return torch_eager_bytes(w, peer) if is_torch(peer) else flashpar_eager_bytes(w, peer)


def kernels(w: Workload, peer: Peer) -> tuple[int, int]:
    """(forward, backward) elementwise launches of one block: ``KERNELS_PER_BLOCK``, flashpar's eager block its
    own count (backward twice forward, as in ``KERNELS_PER_BLOCK``)."""
    if compiled(w, peer) or is_torch(peer):
        return KERNELS_PER_BLOCK
    n = flashpar_eager_kernels(w)
    return n, 2 * n


def elementwise(w: Workload, peer: Peer, hw: Hardware) -> tuple[Part, Part]:
    """(forward, backward) of a block's elementwise work (``elementwise_bytes`` at memory bandwidth) and its
    kernel launches (``kernels``); backward moves twice the bytes."""
    t = hw.memory_time(elementwise_bytes(w, peer))
    fwd, bwd = kernels(w, peer)
    return Part.of(t + fwd * hw.gemm_overhead_s), Part.of(2 * t + bwd * hw.gemm_overhead_s)

"""flashpar.models.fused: RoPE on the fused q/k/v output and SwiGLU on the fused gate/up output, one autograd
node each, against the plain ops the single-process reference model uses (``flashpar.models.llama``), in
float64, forward and backward."""

import pytest
import torch
import torch.nn.functional as F

from flashpar.models.config import LlamaConfig, RopeScaling
from flashpar.models.fused import rope_qkv, rope_tables, swiglu
from flashpar.models.llama import rope

# float64 throughout: the fused ops compute the same products and sums as the reference, in another order
# (x1 c - x2 s as a fused multiply-add instead of x c + rotate_half(x) s); 1e-12 is a few thousand ulps of
# values of order 1, far below any real error and far above float64 rounding.
TOL = 1e-12


def _config(heads: int, kv_heads: int, scaling: RopeScaling | None = None) -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden=heads * 8, layers=1, heads=heads, kv_heads=kv_heads, ffn=48,
                       rope_scaling=scaling)


def _positions() -> torch.Tensor:  # three packed documents' positions, as a plan's cp rank sees them
    return torch.tensor([0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8])


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1), (2, 1)])
@pytest.mark.parametrize("scaled", [False, True])
def test_rope_qkv_matches_plain_rope(heads, kv_heads, scaled):
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8) if scaled else None
    cfg = _config(heads, kv_heads, scaling)
    d, pos = cfg.head_dim, _positions()
    t = pos.shape[0]
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, dtype=torch.float64, generator=gen, requires_grad=True)
    ref = qkv.detach().clone().requires_grad_(True)
    q, k, v = rope_qkv(qkv, rope_tables(pos, cfg, torch.float64), heads, kv_heads)
    q0, k0, v0 = ref.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    rq, rk, rv = rope(q0.reshape(t, heads, d), pos, cfg), rope(k0.reshape(t, kv_heads, d), pos, cfg), v0.reshape(
        t, kv_heads, d)
    for got, want in ((q, rq), (k, rk), (v, rv)):
        assert got.shape == want.shape and got.is_contiguous()
        assert (got - want).abs().max() < TOL
    weights = [torch.randn(x.shape, dtype=torch.float64, generator=gen) for x in (q, k, v)]
    sum((x * w).sum() for x, w in zip((q, k, v), weights, strict=True)).backward()
    sum((x * w).sum() for x, w in zip((rq, rk, rv), weights, strict=True)).backward()
    assert (qkv.grad - ref.grad).abs().max() < TOL


def test_rope_qkv_gradcheck_and_unused_outputs():
    cfg = _config(4, 2)
    pos = _positions()[:6]
    tables = rope_tables(pos, cfg, torch.float64)
    qkv = torch.randn(6, 8 * cfg.head_dim, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: rope_qkv(x, tables, 4, 2), (qkv,))
    # only q reaches the loss: k's and v's columns of the gradient are zero, not left uninitialised
    q, _, _ = rope_qkv(qkv, tables, 4, 2)
    q.sum().backward()
    assert torch.count_nonzero(qkv.grad[:, 4 * cfg.head_dim :]) == 0
    assert torch.count_nonzero(qkv.grad[:, : 4 * cfg.head_dim]) > 0


def test_rope_tables_are_the_step_dtype():
    cfg = _config(4, 2)
    cos, sin = rope_tables(_positions(), cfg, torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16 and cos.shape == (15, cfg.head_dim // 2)


def test_rope_qkv_rejects_mismatched_shapes():
    cfg = _config(4, 2)
    tables = rope_tables(_positions(), cfg, torch.float64)
    with pytest.raises(ValueError, match="is not \\[T, 8 x head_dim\\]"):
        rope_qkv(torch.zeros(15, 8 * cfg.head_dim + 1, dtype=torch.float64), tables, 4, 2)
    with pytest.raises(ValueError, match="tables for 15 tokens, qkv has 14"):
        rope_qkv(torch.zeros(14, 8 * cfg.head_dim, dtype=torch.float64), tables, 4, 2)


def test_swiglu_matches_plain_ops():
    gen = torch.Generator().manual_seed(3)
    gu = torch.randn(9, 2 * 12, dtype=torch.float64, generator=gen, requires_grad=True)
    ref = gu.detach().clone().requires_grad_(True)
    g, u = ref.chunk(2, dim=-1)
    want = F.silu(g) * u
    got = swiglu(gu)
    assert (got - want).abs().max() < TOL
    w = torch.randn(want.shape, dtype=torch.float64, generator=gen)
    (got * w).sum().backward()
    (want * w).sum().backward()
    assert (gu.grad - ref.grad).abs().max() < TOL
    assert torch.autograd.gradcheck(swiglu, (gu.detach().clone().requires_grad_(True),))


def test_swiglu_rejects_odd_width():
    with pytest.raises(ValueError, match="last dimension 7 of gate/up is odd"):
        swiglu(torch.zeros(3, 7))

"""The ``flash`` backend's CUDA path (``flashpar.cp.sdpa_cuda``: torch's FlashAttention-2 and memory-efficient SDPA
kernels, the default on CUDA), checked without a GPU and, under ``make gpu-check``, on one.

* On the meta device the very calls a GPU makes bind to the aten schemas, and torch's shape functions give the
  shapes and dtypes the kernels return (the log-sum-exp's padding included).
* On the CPU the same code runs on stand-ins of the kernels (``tests/sdpa_standins.py``: the CUDA code's checks,
  its causal alignments and log-sum-exp layouts, float64 arithmetic) through the real batching, merging and
  ``cp.attention``: against a float64 reference and, batch by batch, against the ``math`` backend.
* ``@pytest.mark.cuda`` (``make gpu-check``): the default backend against ``math`` on a GPU, forward and backward,
  on random segment tasks and on a rank of a long pack; their names say ``cuda_default`` (the report's verdict).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from flashpar.cp import kernels, sdpa_cuda
from flashpar.cp.kernels import batch_backward, batch_forward, make_batches, segment_attention
from flashpar.cp.lengths import resolve_lengths
from sdpa_standins import STANDINS, Recorder, efficient_bwd, efficient_fwd, flash_fwd
from test_cp_kernels import _brute, _cp_attention_against_float64, _random_tasks


@pytest.fixture
def cuda_path_on_cpu(monkeypatch):
    """The ``flash`` backend on CPU tensors runs the CUDA path, on the stand-ins; yields their call counts."""
    rec = Recorder(STANDINS)
    monkeypatch.setitem(kernels.FLASH_KERNELS, "cpu", kernels.FLASH_KERNELS["cuda"])
    monkeypatch.setattr(sdpa_cuda, "ATEN", rec.ops)
    return rec.counts


def test_the_default_backend_is_a_fused_kernel_on_cpu_and_cuda():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert kernels.default_backend(cpu, torch.bfloat16, 128) == kernels.CPU_DEFAULT_BACKEND == "flash"
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for d in (12, 64, 128, 320):  # (every head dim: padded to a multiple of 8; above 256 the efficient kernel)
            assert kernels.default_backend(cuda, dtype, d) == kernels.CUDA_DEFAULT_BACKEND == "flash"
    assert kernels.default_backend(cuda) == "flash"
    assert kernels.default_backend(cuda, torch.float64, 64) == "math"  # no fused CUDA kernel takes float64
    assert kernels.default_backend(torch.device("mps"), torch.float32, 64) == "math"
    # which kernel a batch takes: FlashAttention-2 where it can (half precision, no key mask, head dim <= 256)
    assert sdpa_cuda.kernel_for(torch.bfloat16, 128, masked=False) == "flash"
    assert sdpa_cuda.kernel_for(torch.float16, 252, masked=False) == "flash"  # (256 once padded)
    assert sdpa_cuda.kernel_for(torch.bfloat16, 260, masked=False) == "efficient"
    assert sdpa_cuda.kernel_for(torch.bfloat16, 128, masked=True) == "efficient"
    assert sdpa_cuda.kernel_for(torch.float32, 128, masked=False) == "efficient"
    x = torch.zeros(1, 2, 4, 8, device="meta")
    with pytest.raises(ValueError, match=r"^cp flash backend: no fused attention kernel on mps; use backend='math'$"):
        kernels._flash_kernels(torch.device("mps"))
    with pytest.raises(ValueError, match=r"on meta: .* float16, bfloat16 or float32, got torch.float64; use backend"):
        sdpa_cuda.forward(x.double(), x.double(), x.double(), False, None, 0.5)
    with pytest.raises(ValueError, match=r"^cp flash backend: a causal batch must be square, got 4 queries and 6 keys"):
        sdpa_cuda.forward(x, torch.zeros(1, 2, 6, 8, device="meta"), torch.zeros(1, 2, 6, 8, device="meta"), True,
                          None, 0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_flash_backend_cuda_calls_match_the_op_schemas_on_meta(monkeypatch, dtype):
    """The CUDA path run on the meta device: ``aten::_scaled_dot_product_flash_attention`` / ``_efficient_attention``
    and their backwards bind the calls the GPU makes (a misplaced or mistyped argument fails to bind), and torch's
    shape functions return what the kernels return; the results come back as ``[n, H, D]`` rows in the operands'
    dtype with a float32 ``[n, H]`` log-sum-exp (the efficient kernel's padded one cut to the rows).  bf16 takes
    FlashAttention-2 for the unmasked batches and the efficient kernel for the key-padded ones; fp32 the efficient
    kernel alone."""
    rec = Recorder(sdpa_cuda.ATEN)
    monkeypatch.setattr(sdpa_cuda, "ATEN", rec.ops)
    meta = torch.device("meta")
    t, nb, h, hkv, d = 60, 40, 8, 2, 64
    q = torch.empty(t, h, d, dtype=dtype, device=meta)
    k, v, kb, vb = (torch.empty(n, hkv, d, dtype=dtype, device=meta) for n in (t, t, nb, nb))
    tasks = _random_tasks(random.Random(3), t, nb)
    bufs = {-1: (k, v), 0: (kb, vb)}
    out, lse = torch.empty(t, h, d, device=meta), torch.empty(t, h, device=meta)  # merged, float32
    batches = [b.to(meta) for b in make_batches(tasks)]
    assert any(b.key_valid is not None for b in batches) and any(b.q_span is not None for b in batches)
    for b in batches:
        rows, o, m = batch_forward(b, q, *bufs[b.buf], 0.125, "flash")
        n = torch.arange(t)[b.rows].numel()
        assert (o.shape, o.dtype, m.shape, m.dtype) == ((n, h, d), dtype, (n, h), torch.float32)
        dq, dk, dv = batch_backward(b, q, *bufs[b.buf], out.to(dtype), out.to(dtype), lse, 0.125, "flash")
        nk = torch.arange(bufs[b.buf][0].shape[0])[b.keys].numel()
        assert dq.shape == (n, h, d) and dk.shape == dv.shape == (nk, hkv, d)
        assert dq.dtype == dk.dtype == dv.dtype == dtype
    masked = 2 * sum(b.key_valid is not None for b in batches)  # (forward and backward)
    want = {"flash": 2 * len(batches) - masked, "efficient": masked} if dtype == torch.bfloat16 else \
        {"flash": 0, "efficient": 2 * len(batches)}
    assert rec.counts == want


def test_the_standins_hold_the_kernels_contracts():
    """The stand-ins refuse what the CUDA kernels refuse or misread, and align causal blocks as each kernel does
    (else the CPU runs below could pass calls a GPU rejects)."""
    bf = dict(dtype=torch.bfloat16)
    q, k = torch.randn(1, 4, 3, 8, **bf), torch.randn(1, 2, 5, 8, **bf)
    # a non-square causal block: FlashAttention-2 lower-right (query 0 sees keys 0..2), efficient upper-left (key 0)
    out_f, lse_f = flash_fwd(q, k, k, 0.0, True, False, scale=0.5)[:2]
    kk = k.repeat_interleave(2, 1)
    out_e, lse_e = efficient_fwd(q, kk, kk, None, True, 0.0, True, scale=0.5)[:2]
    s = 0.5 * q[0, 0].double() @ k[0, 0].double().T
    assert lse_f[0, 0, 0].item() == pytest.approx(s[0, :3].logsumexp(0).item(), rel=1e-6)
    assert lse_e[0, 0, 0].item() == pytest.approx(s[0, 0].item(), rel=1e-6)
    assert lse_e.shape == (1, 4, 32) and bool((lse_e[..., 3:] == math.inf).all())  # padded to 32 columns with +inf
    with pytest.raises(AssertionError, match="dtype torch.float32"):
        flash_fwd(q.float(), k.float(), k.float(), 0.0, False, False, scale=0.5)
    with pytest.raises(AssertionError, match="heads 4 and 2"):
        efficient_fwd(q, k, k, None, True, 0.0, False, scale=0.5)
    dout, o = torch.zeros_like(q), torch.zeros_like(q)
    with pytest.raises(AssertionError, match="must be \\+inf"):
        efficient_bwd(dout, q, kk, kk, None, o, torch.zeros(1, 4, 32), None, None, 0.0, [True, True, True, False],
                      False, scale=0.5)
    with pytest.raises(AssertionError, match="lse \\(1, 4, 3\\)"):
        efficient_bwd(dout, q, kk, kk, None, o, lse_e[..., :3], None, None, 0.0, [True, True, True, False], False,
                      scale=0.5)
    bias = torch.zeros(1, 1, 1, 5, **bf).expand(1, 4, 3, 5)  # row stride 5: not a multiple of 8 elements
    with pytest.raises(AssertionError, match="not correctly aligned"):
        efficient_fwd(q, kk, kk, bias, True, 0.0, False, scale=0.5)
    with pytest.raises(AssertionError, match="invalid dtype for bias"):
        efficient_fwd(q, kk, kk, torch.zeros(1, 1, 1, 16)[..., :5].expand(1, 4, 3, 5), True, 0.0, False, scale=0.5)


def _operands(dtype, d, seed, t=60, nb=40, h=4, hkv=2):
    """Random q, own K/V and a peer buffer, exactly representable in ``dtype`` (the float64 reference takes the
    same values)."""
    gen = torch.Generator().manual_seed(seed)
    mk = lambda n, heads: torch.randn(n, heads, d, generator=gen).to(dtype)  # noqa: E731
    return mk(t, h), mk(t, hkv), mk(t, hkv), mk(nb, hkv), mk(nb, hkv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 12])  # 12: padded to 16 for the kernels
@pytest.mark.parametrize("seed", range(2))
def test_cuda_path_batches_match_math_in_float64(cuda_path_on_cpu, dtype, d, seed):
    """Batch by batch (causal squares and full rectangles, direct and padded, key-padded ones through the efficient
    kernel's bias; GQA 4 / 2), the CUDA path's forward and backward against the ``math`` backend on the same values
    in float64, rounded once to ``dtype``: the stand-ins compute in float64 and round once too, so the two agree to
    the rounding of the last bit (one ulp of the result: rtol 2^-23 in fp32, 2^-7 in bf16) except where a
    float64 sum lands on a rounding boundary (and GQA's dK, dV: rounded per query head, then added); a wrong key, a
    lost bias or a misread log-sum-exp is O(1)."""
    q, k, v, kb, vb = _operands(dtype, d, seed)
    tasks = _random_tasks(random.Random(seed), q.shape[0], kb.shape[0])
    bufs = {-1: (k, v), 0: (kb, vb)}
    wide = {-1: (k.double(), v.double()), 0: (kb.double(), vb.double())}
    gen = torch.Generator().manual_seed(seed + 10)
    dout = torch.randn(q.shape, generator=gen).to(dtype)
    out = torch.randn(q.shape, generator=gen).to(dtype)  # any merged out and lse: each batch's share is exact
    lse = (torch.rand(q.shape[:2], generator=gen) * 3 + 2).float()
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -23
    batches = make_batches(tasks)
    assert {b.causal for b in batches} == {True, False} and any(b.key_valid is not None for b in batches)
    assert any(b.q_span is not None for b in batches) and any(b.q_span is None for b in batches)
    for b in batches:
        rows, o, m = batch_forward(b, q, *bufs[b.buf], 0.4, "flash")
        _, o64, m64 = batch_forward(b, q.double(), *wide[b.buf], 0.4, "math")
        assert o.dtype == dtype and m.dtype == torch.float32
        torch.testing.assert_close(o.double(), o64.to(dtype).double(), rtol=ulp, atol=0)
        torch.testing.assert_close(m.double(), m64, rtol=2.0 ** -23, atol=0)  # float32 of the float64 lse
        got = batch_backward(b, q, *bufs[b.buf], dout, out, lse, 0.4, "flash")
        want = batch_backward(b, q.double(), *wide[b.buf], dout.double(), out.double(), lse.double(), 0.4, "math")
        for i, (x, y) in enumerate(zip(got, want, strict=True)):
            assert x.dtype == dtype
            # dK, dV of GQA: each query head's share is rounded, then the group's (2) are added: within an ulp of the
            # largest entry (the float64 reference adds first)
            atol = 0.0 if i == 0 else 2 * ulp * y.abs().max().item()
            torch.testing.assert_close(x.double(), y.to(dtype).double(), rtol=ulp, atol=atol)
    kinds = {"flash", "efficient"} if dtype == torch.bfloat16 else {"efficient"}
    assert {name for name, c in cuda_path_on_cpu.items() if c} == kinds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_path_matches_float64_forward_and_backward(cuda_path_on_cpu, dtype):
    """``segment_attention`` and the gradient shares of every batch, merged and added up as ``cp.attention`` does,
    against float64 attention over the keys each task allows (``test_cp_kernels._brute``).  fp32: the stand-ins'
    float64 results rounded once per task to float32 (~1e-7 relative) and merged in float32: out and gradients
    within 1e-5, lse 1e-5.  bf16: the log-sum-exp stays float32 (1e-5); an output, a convex mix of the value rows,
    is rounded once per task to bf16: within 2^-8 of max |v|."""
    q, k, v, kb, vb = _operands(dtype, 16, 7)
    tasks = _random_tasks(random.Random(7), q.shape[0], kb.shape[0])
    leaves = [x.double().requires_grad_() for x in (q, k, v, kb, vb)]
    ref_out, ref_lse = _brute(*leaves, tasks, 0.4)
    out, lse = segment_attention(q, {-1: (k, v), 0: (kb, vb)}, tasks, 0.4)  # the default backend: flash
    atol = 1e-5 if dtype == torch.float32 else 2.0 ** -8 * max(v.abs().max(), vb.abs().max()).item()
    torch.testing.assert_close(out.double(), ref_out.detach(), rtol=0, atol=atol)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=0, atol=1e-5)
    if dtype != torch.float32:
        return  # (bf16 gradients: batch by batch against math above)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(8))
    ref_out.backward(dout.double())
    grads = [torch.zeros(x.shape, dtype=torch.float64) for x in leaves]
    bufs = {-1: (k, v), 0: (kb, vb)}
    for b in make_batches(tasks):
        dq, dk, dv = batch_backward(b, q, *bufs[b.buf], dout, out.to(dtype), lse, 0.4)
        grads[0].index_add_(0, torch.arange(q.shape[0])[b.rows], dq.double())
        keys = torch.arange(bufs[b.buf][0].shape[0])[b.keys]
        grads[1 if b.buf == -1 else 3].index_add_(0, keys, dk.double())
        grads[2 if b.buf == -1 else 4].index_add_(0, keys, dv.double())
    for got, leaf in zip(grads, leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad, rtol=0, atol=1e-5)


def test_cp_attention_runs_the_cuda_path_against_float64(cuda_path_on_cpu):
    """``cp.attention`` at world size 1 (autograd, executor, device layout) with the default backend, the CUDA path on
    the stand-ins, bf16, real document lengths: against float64 attention of the same values.  bf16 output rounded
    once (|out| <= 3: half an ulp 8e-3), gradients once per task share (|g| <= 10); a wrong key is O(1)."""
    lens = resolve_lengths("sotu").packs(512, 1, scale=32)[0]  # speeches / 32: 512 tokens
    _cp_attention_against_float64("cpu", torch.bfloat16, None, lens, atol=2e-2, grad_atol=5e-2)
    assert cuda_path_on_cpu["flash"] > 0  # (world size 1: only causal squares, FlashAttention-2's)


# ----------------------------------------------------------------------------------------------
# on a GPU (make gpu-check)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch's fused SDPA kernels)")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_default_backend_matches_math_on_segment_tasks(dtype):
    """The default backend on CUDA (FlashAttention-2 and the efficient kernel) against ``math`` on random short
    segment tasks (a wrong key moves an output by O(1 / keys): visible here), forward and backward, GQA 8 / 2.
    Both accumulate in float32 and round once to the operands' dtype: bf16 outputs to 8e-3 (half an ulp at 2),
    gradient shares once per task (summed over a few tasks: 5e-2); fp32 to the float32 summation order (1e-4)."""
    assert kernels.default_backend(torch.device("cuda"), dtype, 64) == "flash"
    rng, gen = random.Random(1), torch.Generator(device="cuda").manual_seed(1)
    t, nb, h, hkv, d = 300, 200, 8, 2, 64
    mk = lambda n, heads: torch.randn(n, heads, d, device="cuda", generator=gen).to(dtype)  # noqa: E731
    q, k, v, kb, vb = mk(t, h), mk(t, hkv), mk(t, hkv), mk(nb, hkv), mk(nb, hkv)
    tasks = _random_tasks(rng, t, nb)
    bufs = {-1: (k, v), 0: (kb, vb)}
    out, lse = segment_attention(q, bufs, tasks, 0.125)
    ref_out, ref_lse = segment_attention(q, bufs, tasks, 0.125, "math")
    half = dtype == torch.bfloat16
    torch.testing.assert_close(out, ref_out, rtol=0, atol=2e-2 if half else 1e-4)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-3 if half else 1e-4)
    dout = mk(t, h)

    def grads(backend: str):
        acc = [torch.zeros(x.shape, device="cuda") for x in (q, k, v, kb, vb)]
        for b in make_batches(tasks):
            b = b.to(q.device)
            dq, dk, dv = batch_backward(b, q, *bufs[b.buf], dout, out.to(dtype), lse, 0.125, backend)
            acc[0].index_add_(0, torch.arange(t, device="cuda")[b.rows], dq.float())
            keys = torch.arange(bufs[b.buf][0].shape[0], device="cuda")[b.keys]
            acc[1 if b.buf == -1 else 3].index_add_(0, keys, dk.float())
            acc[2 if b.buf == -1 else 4].index_add_(0, keys, dv.float())
        return acc

    for x, y in zip(grads("flash"), grads("math"), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=5e-2 if half else 1e-4)


@pytest.mark.cuda
@needs_cuda
def test_cuda_default_backend_matches_math_on_a_long_pack():
    """One rank of a flashcp plan of a 64K-token pack over 8 ranks (its own K/V and every peer's, 8K-query causal
    squares against keys up to 56K), Llama-like head dim 128, GQA 2 / 1, bf16, forward and backward: the default
    backend against ``math`` (whose score matrices at this size take tens of GB: why it is not the default).  The
    same rounding as the short tasks (outputs 2e-2, lse 1e-3, gradients 5e-2); a wrong mask, causal alignment or
    log-sum-exp unit moves whole rows by O(1)."""
    from flashpar.cp import plan
    from flashpar.cp.layout import device_layout, rank_layout
    from flashpar.gpu_check.attention_rate import backward, forward

    cuda = torch.device("cuda")
    lens = resolve_lengths("wlbllm").packs(65536, 1)[0]
    p = plan(lens, 8)
    rank = max(range(8), key=lambda r: sum(rank_layout(p, r).recv_tokens(o) for o in range(8)))
    lo = rank_layout(p, rank)
    phases = device_layout(p, rank, False, cuda).phases
    gen = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda n, heads: torch.randn(n, heads, 128, device="cuda", generator=gen).to(torch.bfloat16)  # noqa: E731
    q = mk(lo.tokens, 2)
    bufs = {-1: (mk(lo.tokens, 1), mk(lo.tokens, 1))}
    bufs.update({o: (mk(lo.recv_tokens(o), 1), mk(lo.recv_tokens(o), 1)) for o in range(8) if lo.recv_tokens(o)})
    assert len(bufs) > 1, "the rank receives K/V"
    out, lse = forward(phases, q, bufs, 128 ** -0.5, "flash")
    ref_out, ref_lse = forward(phases, q, bufs, 128 ** -0.5, "math")
    torch.testing.assert_close(out, ref_out, rtol=0, atol=2e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-3)
    dout = mk(lo.tokens, 2)
    got = backward(phases, q, bufs, dout, ref_out.to(q.dtype), ref_lse, 128 ** -0.5, "flash")
    want = backward(phases, q, bufs, dout, ref_out.to(q.dtype), ref_lse, 128 ** -0.5, "math")
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=5e-2)
    for o in bufs:
        for x, y in zip(got[1][o], want[1][o], strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=5e-2)


@pytest.mark.cuda
@needs_cuda
def test_cp_attention_cuda_default_matches_float64():
    """The whole ``cp.attention`` path on CUDA with the default backend, bf16, real document lengths (as
    ``test_cp_kernels.test_cp_attention_on_cuda_matches_float64`` for the named backends, same tolerances)."""
    lens = resolve_lengths("sotu").packs(4096, 1, scale=4)[0]
    _cp_attention_against_float64("cuda", torch.bfloat16, None, lens, atol=2e-2, grad_atol=5e-2)

"""Segment-attention kernels and per-rank task layouts, single process, against brute force."""

from __future__ import annotations

import math
import random

import pytest
import torch

from flashpar.cp import STRATEGIES, plan
from flashpar.cp.kernels import PAD_LIMIT, Task, batch_backward, make_batches, padded_len, segment_attention
from flashpar.cp.layout import rank_layout
from flashpar.cp.lengths import resolve_lengths


def test_padding_ladder_is_tight():
    for n in range(1, 3000):
        p = padded_len(n)
        assert p >= n and (p == n if n > PAD_LIMIT else p <= max(8, 1.25 * n))


def _random_tasks(rng: random.Random, t: int, kb: int) -> list[Task]:
    """Causal blocks tiling [0, t), plus full tasks of some blocks over key runs of a buffer."""
    tasks, q0 = [], 0
    while q0 < t:
        q1 = min(t, q0 + rng.choice([1, 2, 3, 5, 7, 7, 16]))
        tasks.append(Task(q0, q1, -1, q0, q1, True))
        for _ in range(rng.choice([0, 1, 1, 2])):
            k0 = rng.randrange(kb - 8)
            k1 = k0 + rng.randint(1, 8) if rng.random() < 0.7 else rng.randrange(k0 + 1, kb + 1)
            tasks.append(Task(q0, q1, 0, k0, k1, False))
        q0 = q1
    return tasks


def _brute(q, k, v, kb, vb, tasks, scale):
    """float64 attention over the keys [own, buffer] each task allows (duplicates counted once per task)."""
    t, nb = q.shape[0], kb.shape[0]
    count = torch.zeros(t, t + nb, dtype=torch.float64)
    for x in tasks:
        off = 0 if x.buf == -1 else t
        for i in range(x.q0, x.q1):
            for j in range(x.k0, x.k1):
                if not x.causal or j - x.k0 <= i - x.q0:
                    count[i, off + j] += 1
    keys, vals = torch.cat([k, kb]), torch.cat([v, vb])
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("thd,shd->hts", q, keys.repeat_interleave(g, 1)) * scale
    s = s + torch.log(count)  # a key allowed by two tasks counts twice, as two merged tasks count it
    lse = s.logsumexp(-1)
    out = torch.einsum("hts,shd->thd", torch.softmax(s, -1), vals.repeat_interleave(g, 1))
    return out, lse.T


@pytest.mark.parametrize("backend", ["flash", "math", "varlen"])
@pytest.mark.parametrize("seed", range(4))
def test_segment_attention_matches_brute_force_forward_and_backward(backend, seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    t, nb, h, hkv, d, scale = 60, 40, 4, 2, 8, 0.4
    q = torch.randn(t, h, d, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(t, hkv, d, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(2))
    kb, vb = (torch.randn(nb, hkv, d, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(2))
    tasks = _random_tasks(rng, t, nb)
    varlen = backend == "varlen"
    assert varlen or any(b.key_valid is not None for b in make_batches(tasks)), "no padded full batch exercised"
    ref_out, ref_lse = _brute(q, k, v, kb, vb, tasks, scale)
    with torch.no_grad():
        out, lse = segment_attention(q, {-1: (k, v), 0: (kb, vb)}, tasks, scale, backend)
    # float64 throughout: only summation order differs (~1e-15); a wrong key is O(1)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    dout = torch.randn_like(out)
    ref_out.backward(dout)
    grads = {"q": torch.zeros_like(q), -1: [torch.zeros_like(k), torch.zeros_like(v)],
             0: [torch.zeros_like(kb), torch.zeros_like(vb)]}
    bufs = {-1: (k.detach(), v.detach()), 0: (kb.detach(), vb.detach())}
    for b in make_batches(tasks, varlen):
        dq, dk, dv = batch_backward(b, q.detach(), *bufs[b.buf], dout, out, lse, scale, backend)
        rows = torch.arange(t)[b.rows]
        keys = torch.arange(bufs[b.buf][0].shape[0])[b.keys]
        grads["q"].index_add_(0, rows, dq)
        grads[b.buf][0].index_add_(0, keys, dk)
        grads[b.buf][1].index_add_(0, keys, dv)
    for got, ref in ((grads["q"], q.grad), (grads[-1][0], k.grad), (grads[-1][1], v.grad),
                     (grads[0][0], kb.grad), (grads[0][1], vb.grad)):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-11)


def test_many_short_documents_make_few_kernel_calls():
    tasks = []
    for i in range(2000):
        tasks.append(Task(i, i + 1, -1, i, i + 1, True))
    assert len(make_batches(tasks)) == 1
    lens = [1 + (i * 7) % 40 for i in range(500)]
    p = plan(lens, 1, strategy="contiguous")
    calls = sum(len(ph) for ph in rank_layout(p, 0).phases)
    assert calls <= 20, calls  # 500 documents, at most a batch per ladder length
    assert sum(len(ph) for ph in rank_layout(p, 0, True).phases) == 1  # varlen: one launch per phase and kind


def test_varlen_flash_calls_match_the_op_schemas_on_meta():
    """The CUDA path of the varlen backend, run on the meta device: torch's shape functions of
    ``aten::_flash_attention_forward`` / ``_flash_attention_backward`` bind the very calls the GPU makes
    (a misplaced argument fails to match the schema) and give the shapes and dtypes the kernels return."""
    from flashpar.cp import kernels

    rng, meta = random.Random(3), torch.device("meta")
    t, nb, h, hkv, d = 60, 40, 8, 2, 64
    q = torch.empty(t, h, d, dtype=torch.bfloat16, device=meta)
    k, v, kb, vb = (torch.empty(n, hkv, d, dtype=torch.bfloat16, device=meta) for n in (t, t, nb, nb))
    tasks = _random_tasks(rng, t, nb)
    bufs = {-1: (k, v), 0: (kb, vb)}
    out, lse = torch.empty(t, h, d, device=meta), torch.empty(t, h, device=meta)  # merged, float32 (merge: not on meta)
    batches = [b.to(meta) for b in make_batches(tasks, varlen=True)]
    assert {b.causal for b in batches} == {True, False} and all(b.cu_q.device == meta for b in batches)
    for b in batches:
        rows, o, m = kernels.batch_forward(b, q, *bufs[b.buf], 0.125, "varlen")
        n = b.q_rows.numel()
        assert (o.shape, o.dtype, m.shape, m.dtype) == ((n, h, d), torch.bfloat16, (n, h), torch.float32)
        dq, dk, dv = batch_backward(b, q, *bufs[b.buf], out.to(q.dtype), out, lse, 0.125, "varlen")
        assert dq.shape == (b.q_rows.numel(), h, d) and dk.shape == dv.shape == (b.k_rows.numel(), hkv, d)
        assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16
    # operands FlashAttention-2 refuses (its TORCH_CHECKs, which the meta functions skip): one clear line
    with pytest.raises(ValueError, match=r"bfloat16, got torch.float32\); use backend='flash' \(the default\)"):
        kernels.batch_forward(batches[0], q.float(), k.float(), v.float(), 0.125, "varlen")
    q12, k12 = torch.empty(t, h, 12, device=meta, dtype=torch.bfloat16), torch.empty(t, hkv, 12, device=meta,
                                                                                    dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 8 and at most 256, got 12"):
        kernels.batch_forward(make_batches([Task(0, t, -1, 0, t, True)], True)[0].to(meta), q12, k12, k12, 0.125,
                              "varlen")


@pytest.mark.cuda  # run by make gpu-check (python -m flashpar.gpu_check) on a GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (FlashAttention-2 varlen kernel)")
@pytest.mark.parametrize("seed", range(2))
def test_varlen_cuda_kernel_matches_math(seed):
    """The CUDA variable-length kernel against the math backend on the same packed batches (bf16)."""
    rng, gen = random.Random(seed), torch.Generator(device="cuda").manual_seed(seed)
    t, nb, h, hkv, d = 300, 200, 8, 2, 64
    mk = lambda n, heads: torch.randn(n, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    q, k, v, kb, vb = mk(t, h), mk(t, hkv), mk(t, hkv), mk(nb, hkv), mk(nb, hkv)
    tasks = _random_tasks(rng, t, nb)
    bufs = {-1: (k, v), 0: (kb, vb)}
    out, lse = segment_attention(q, bufs, tasks, 0.125, "varlen")
    ref_out, ref_lse = segment_attention(q, bufs, tasks, 0.125, "math")
    # bf16 inputs, fp32 accumulation in both; outputs rounded to bf16 once (unit roundoff 3.9e-3)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=2e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-3)
    dout = mk(t, h)

    def grads(varlen: bool, backend: str):
        acc = [torch.zeros(x.shape, device="cuda") for x in (q, k, v, kb, vb)]
        for b in make_batches(tasks, varlen):
            b = b.to(q.device)  # the kernels' offsets and masks on the GPU, as cp.attention's device layout has them
            dq, dk, dv = batch_backward(b, q, *bufs[b.buf], dout, out.to(q.dtype), lse, 0.125, backend)
            rows = torch.arange(t, device="cuda")[b.rows]
            keys = torch.arange(bufs[b.buf][0].shape[0], device="cuda")[b.keys]
            acc[0].index_add_(0, rows, dq.float())
            acc[1 if b.buf == -1 else 3].index_add_(0, keys, dk.float())
            acc[2 if b.buf == -1 else 4].index_add_(0, keys, dv.float())
        return acc

    for x, y in zip(grads(True, "varlen"), grads(False, "math"), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=5e-2)


def _cp_attention_against_float64(device: str, dtype: torch.dtype, backend: str, lens: list[int], atol: float,
                                  grad_atol: float) -> None:
    """``cp.attention`` at world size 1 (autograd, its executor and device layout on ``device``) against the
    float64 document-masked causal attention of the same full tensors, forward and backward."""
    from flashpar import cp

    p = plan(lens, 1)
    t, h, hkv, d = sum(lens), 8, 2, 64
    gen = torch.Generator(device=device).manual_seed(0)
    full = [torch.randn(t, n, d, device=device, generator=gen).to(dtype) for n in (h, hkv, hkv, h)]
    doc = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(t, t, dtype=torch.bool, device=device).tril()
    ref = [x.double().requires_grad_() for x in full[:3]]
    s = torch.einsum("thd,shd->hts", ref[0], ref[1].repeat_interleave(h // hkv, 1)) * d ** -0.5
    ref_out = torch.einsum("hts,shd->thd", torch.softmax(s.masked_fill(~allowed, -math.inf), -1),
                           ref[2].repeat_interleave(h // hkv, 1))
    ref_out.backward(full[3].double())
    q, k, v = (cp.shard(x, p, 0).detach().requires_grad_() for x in full[:3])
    out = cp.attention(q, k, v, p, backend=backend)
    out.backward(cp.shard(full[3], p, 0))
    torch.testing.assert_close(out.double(), cp.shard(ref_out, p, 0).detach(), rtol=0, atol=atol)
    for got, want in zip((q.grad, k.grad, v.grad), ref, strict=True):
        torch.testing.assert_close(got.double(), cp.shard(want.grad, p, 0), rtol=0, atol=grad_atol)


@pytest.mark.cuda  # run by make gpu-check (python -m flashpar.gpu_check) on a GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["math", "varlen"])
def test_cp_attention_on_cuda_matches_float64(backend):
    """The whole ``cp.attention`` path on CUDA (never run before gpu-check), bf16, real document lengths."""
    lens = resolve_lengths("sotu").packs(4096, 1, scale=4)[0]  # real speech lengths / 4, packed: 4096 tokens
    # bf16 operands (the reference takes the same rounded values) with fp32 accumulation: the output (|out| <= 3.3)
    # is rounded to bf16 once (half an ulp: 8e-3), gradients (|g| <= 10) once per task share; the math backend on
    # the CPU is off by 7.7e-3 (out) and 1.8e-2 (grads) here, a wrong key by O(1)
    _cp_attention_against_float64("cuda", torch.bfloat16, backend, lens, atol=2e-2, grad_atol=5e-2)


@pytest.mark.parametrize("some", [False, True], ids=["every query", "some queries"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_layout_tasks_cover_exactly_the_document_mask(strategy, n, some):
    """Every (query, key) pair the causal document mask allows is computed exactly once, and nothing else; with
    ``queries`` (a random third of the local rows and the first rows of the first two pieces) the pairs of those
    queries only."""
    rng = random.Random(n * 31 + len(strategy))
    lens = [rng.choice([1, 2, 5, 9, 20, 41]) for _ in range(9)]
    p = plan(lens, n, strategy=strategy)
    starts = p.doc_starts
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    for r in range(n):
        local = p.local_indices(r)
        rows = None
        if some:
            firsts = [sum(b - a for a, b in p.segments[r][:i]) for i in range(len(p.segments[r]))]
            rows = tuple(sorted({*rng.sample(range(local.numel()), local.numel() // 3), *firsts[:2]}))
        lo = rank_layout(p, r, queries=rows)
        glob = {-1: local}
        for origin in range(n):
            ranges = lo.recv[origin]
            glob[origin] = torch.cat([torch.arange(a, b) for a, b in ranges] + [torch.empty(0, dtype=torch.long)])
        seen: dict[tuple[int, int], int] = {}
        for phase_id, phase in enumerate(lo.phases):
            for b in phase:
                assert b.buf == (-1 if phase_id == 0 else lo.origin(phase_id))
                for task in _tasks_of(b):
                    for i in range(task[0], task[1]):
                        for j in range(task[2], task[3]):
                            if task[4] and j - task[2] > i - task[0]:
                                continue
                            key = (int(local[i]), int(glob[b.buf][j]))
                            seen[key] = seen.get(key, 0) + 1
        asked = local if rows is None else local[list(rows)]
        want = {(int(qi), int(kj)) for qi in asked for kj in range(starts[int(doc[qi])], int(qi) + 1)}
        assert set(seen) == want and set(seen.values()) <= {1}, (strategy, n, r)


def _tasks_of(batch):
    """(q0, q1, k0, k1, causal) per task of a batch, padded or direct."""
    if batch.q_span is not None:
        return [(*batch.q_span, *batch.k_span, batch.causal)]
    out = []
    for b in range(batch.B):
        qsel = (batch.q_pos >= b * batch.Lq) & (batch.q_pos < (b + 1) * batch.Lq)
        ksel = (batch.k_pos >= b * batch.Lk) & (batch.k_pos < (b + 1) * batch.Lk)
        qr, kr = batch.q_rows[qsel], batch.k_rows[ksel]
        assert bool((qr.diff() == 1).all()) and bool((kr.diff() == 1).all())
        out.append((int(qr[0]), int(qr[-1]) + 1, int(kr[0]), int(kr[-1]) + 1, batch.causal))
    return out


def test_merge_is_the_log_sum_exp_rule():
    from flashpar.cp.kernels import merge

    s = torch.randn(5, 3, 11, dtype=torch.float64)
    v = torch.randn(5, 3, 11, 4, dtype=torch.float64)
    out = torch.zeros(5, 3, 4, dtype=torch.float64)
    lse = torch.full((5, 3), -math.inf, dtype=torch.float64)
    for part in (slice(0, 4), slice(4, 5), slice(5, 11)):
        sp = s[..., part]
        lp = sp.logsumexp(-1)
        merge(out, lse, slice(None), (torch.softmax(sp, -1).unsqueeze(-1) * v[..., part, :]).sum(-2), lp)
    torch.testing.assert_close(lse, s.logsumexp(-1), rtol=0, atol=1e-13)
    torch.testing.assert_close(out, (torch.softmax(s, -1).unsqueeze(-1) * v).sum(-2), rtol=0, atol=1e-13)

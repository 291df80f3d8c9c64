"""The torch peer's attention kernels and index lists (``flashpar.bench.torch_attention``) against a dense float64
reference, one process: the cp group's gather is the reference's K/V taken in the gathered order."""

from __future__ import annotations

import pytest
import torch

from flashpar.bench import torch_attention as ta

DOCS = [12, 24, 4, 36, 20]  # multiples of 2 cp for cp 1..2; cp 3 uses DOCS3
DOCS3 = [12, 24, 6, 36, 18]


def _reference(q, k, v, doc_lens):
    """Dense document-causal attention over the whole sequence, float64: ``[1, H, S, D]``."""
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
    pos = torch.arange(doc.numel())
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def _inputs(total, heads=4, kv_heads=2, d=8):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(1, h, total, d, generator=gen, dtype=torch.float64, requires_grad=True)
            for h in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("kind", ["docs", "dense", "flex"])
@pytest.mark.parametrize("cp", [1, 2, 3])
def test_every_rank_attention_matches_the_dense_reference_forward_and_backward(kind, cp):
    """Each cp rank's output and the gradients it sends back to q, k, v (scattered to the sequence's order) add up
    to the dense reference's in float64: 1e-12 relative leaves room for the softmax's sums in another order.
    FlexAttention has no backward on CPU ("does not support backward on CPU"): its forward only here, its backward
    on CUDA in ``make gpu-check``."""
    docs = DOCS3 if cp == 3 else DOCS
    q, k, v = _inputs(sum(docs))
    ref = _reference(q, k, v, docs)
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    out = torch.zeros_like(ref)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(cp):
        order = None
        if kind == "dense" and cp > 1:
            from flashpar.bench.torch_parallel import torch_order

            order = torch_order(docs, cp)
        layout = ta.build_layout(docs, cp, rank, kind, "cpu", order=order)
        mine, gathered = layout.mine, layout.order
        ql = q.detach()[:, :, mine].requires_grad_()
        kg, vg = k.detach()[:, :, gathered].requires_grad_(), v.detach()[:, :, gathered].requires_grad_()
        if kind == "flex":
            out[:, :, mine] = ta.attend(ql.detach(), kg.detach(), vg.detach(), layout)
            continue
        o = ta.attend(ql, kg, vg, layout)
        out[:, :, mine] = o.detach()
        gq, gk, gv = torch.autograd.grad(o, (ql, kg, vg), grad_out[:, :, mine])
        grads[0][:, :, mine] += gq
        grads[1][:, :, gathered] += gk
        grads[2][:, :, gathered] += gv
    ref = ref.detach()
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-12
    if kind == "flex":
        return
    for g, r in zip(grads, ref_grads, strict=True):
        assert float((g - r).abs().max() / r.abs().max()) < 1e-12


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_head_tail_layout_gives_every_rank_its_head_and_tail_of_each_document_and_equal_causal_pairs(cp):
    docs = [8 * cp, 4 * cp, 2 * cp, 16 * cp]
    order = ta.head_tail_order(docs, cp)
    assert sorted(order.tolist()) == list(range(sum(docs)))
    starts = [sum(docs[:i]) for i in range(len(docs))]
    start_of = {p: s for s, n in zip(starts, docs, strict=True) for p in range(s, s + n)}
    pairs = []
    for r in range(cp):
        mine = order.view(cp, -1)[r].tolist()
        expect = []
        for s, n in zip(starts, docs, strict=True):
            c = n // (2 * cp)
            expect += [*range(s + r * c, s + (r + 1) * c), *range(s + (2 * cp - 1 - r) * c, s + (2 * cp - r) * c)]
        assert mine == expect
        pairs.append(sum(p - start_of[p] + 1 for p in mine))  # causal pairs: each query sees its earlier keys
    assert len(set(pairs)) == 1, pairs


def test_torch_213_order_cut_in_contiguous_pieces_is_unbalanced_which_the_dense_peer_keeps():
    from flashpar.bench.torch_parallel import torch_order

    docs = [40, 8, 24, 8]
    order = torch_order(docs, 2)
    start_of = {p: s for s, n in zip([0, 40, 48, 72], docs, strict=True) for p in range(s, s + n)}
    pairs = [sum(p - start_of[p] + 1 for p in order.view(2, -1)[r].tolist()) for r in range(2)]
    assert sorted(order.tolist()) == list(range(80)) and pairs[0] != pairs[1]


def test_chunks_are_one_per_document_chunk_and_docs_masks_are_lower_right():
    layout = ta.build_layout([8, 4], 2, 1, "docs", "cpu")  # rank 1 of cp 2: chunks 1 and 2 of each document
    assert [(c.q0, c.q1, c.s, c.a) for c in layout.chunks] == [(0, 2, 0, 2), (2, 4, 0, 4), (4, 5, 8, 9),
                                                                (5, 6, 8, 10)]
    assert torch.equal(layout.chunks[1].mask, torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]).bool())
    assert [(c.q0, c.q1) for c in ta.build_layout([8, 4], 1, 0, "docs", "cpu").chunks] == [(0, 8), (8, 12)]
    rank0 = ta.build_layout([8, 4], 2, 0, "docs", "cpu")
    assert rank0.chunks[0].mask is None  # a document's first chunk: square, SDPA's is_causal


def test_varlen_offsets_list_every_chunk_and_its_key_range():
    layout = ta.build_layout([8, 4], 2, 1, "varlen", "cpu")
    t = layout.extra
    assert t["cu_q"].tolist() == [0, 2, 4, 5, 6] and t["cu_k"].tolist() == [0, 4, 10, 12, 15]
    assert t["key_index"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 8, 9, 8, 9, 10]
    assert (t["max_q"], t["max_k"]) == (2, 6)
    assert t["cu_q"].dtype == t["cu_k"].dtype == torch.int32


def test_bad_documents_and_kind_are_refused_with_one_line():
    with pytest.raises(ValueError, match="multiple of 2 cp = 4"):
        ta.head_tail_order([6, 8], 2)
    with pytest.raises(ValueError, match="expected one of"):
        ta.build_layout([8], 1, 0, "sparse", "cpu")


@pytest.mark.cuda  # run by make gpu-check (python -m flashpar.gpu_check) on a GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["flex", "packed"])
def test_peer_cuda_kernels_match_the_reference_in_bf16(kind):
    """FlexAttention (compiled, document-causal block mask) and varlen_attn (per-(document, chunk) offsets) on CUDA
    in bf16 against the float64 reference: bf16 keeps 8 bits of mantissa, so 2e-2 of the largest output."""
    kind = "varlen" if kind == "packed" else kind
    docs = [256, 512, 128, 1024, 128]
    q, k, v = (t.detach() for t in _inputs(sum(docs), heads=8, kv_heads=4, d=64))
    ref = _reference(q, k, v, docs)
    for rank in range(2):
        layout = ta.build_layout(docs, 2, rank, kind, "cuda")
        ql = q[:, :, layout.mine].cuda().bfloat16()
        kg, vg = (t[:, :, layout.order].cuda().bfloat16() for t in (k, v))
        if kind == "flex":
            from torch.nn.attention.flex_attention import flex_attention

            compiled = torch.compile(flex_attention)
            o = compiled(ql, kg, vg, block_mask=layout.extra["block_mask"], enable_gqa=True)
        else:
            o = ta.attend(ql, kg, vg, layout)
        err = (o.double().cpu() - ref[:, :, layout.mine]).abs().max() / ref.abs().max()
        assert float(err) < 2e-2, (kind, rank, float(err))

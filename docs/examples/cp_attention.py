"""Context-parallel attention (FlashCP): a plan executed forward and backward, checked against full attention
under the causal document mask.

Run: torchrun --nproc-per-node 2 docs/examples/cp_attention.py
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flashpar.cp as cp


def main(rank: int, world: int) -> None:
    doc_lens, heads, kv_heads, head_dim = [300, 20, 900, 64, 45], 4, 2, 16
    tokens = sum(doc_lens)
    g = torch.Generator().manual_seed(0)                      # every rank the same full tensors
    q_full, grad = (torch.randn(tokens, heads, head_dim, generator=g) for _ in range(2))
    k_full, v_full = (torch.randn(tokens, kv_heads, head_dim, generator=g) for _ in range(2))

    p = cp.plan(doc_lens, world)                              # every rank computes the same plan (deterministic)
    q, k, v = (cp.shard(x, p, rank).requires_grad_() for x in (q_full, k_full, v_full))   # THD: [T_local, H, D]
    out = cp.attention(q, k, v, p, group=None)                # == full causal document-masked attention, sharded
    out.backward(cp.shard(grad, p, rank))                     # dq, dk, dv exact; remote dK/dV summed at their owners
    out_full, dq_full = cp.gather(out, p, None), cp.gather(q.grad, p, None)   # the whole sequence back
    p.position_ids(rank)                                      # RoPE positions of the local tokens

    # the reference: one process, the whole sequence, a document-causal mask
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
    mask = (doc[:, None] == doc[None, :]) & torch.ones(tokens, tokens, dtype=torch.bool).tril()
    ref_q = q_full.clone().requires_grad_()
    ref = F.scaled_dot_product_attention(ref_q.transpose(0, 1), k_full.transpose(0, 1), v_full.transpose(0, 1),
                                         attn_mask=mask, enable_gqa=True).transpose(0, 1)
    ref.backward(grad)
    torch.testing.assert_close(out_full, ref, rtol=1e-5, atol=1e-5)   # fp32: same sums, merged in another order
    torch.testing.assert_close(dq_full, ref_q.grad, rtol=1e-5, atol=1e-5)
    if rank == 0:
        print(f"cp_attention: the planned attention and its dq equal full attention on {world} ranks (fp32)")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()

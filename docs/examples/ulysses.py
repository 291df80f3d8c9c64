"""Ulysses attention: both all-to-alls fused with the projections, checked against the full attention block.

Run: torchrun --nproc-per-node 2 docs/examples/ulysses.py
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flashpar.overlap import UlyssesAttention


def main(rank: int, world: int) -> None:
    s, hidden, heads, kv_heads, head_dim = 8 * world, 32, 4, 2, 8
    torch.manual_seed(0)                                          # every rank the same weights and input
    q_proj, k_proj, v_proj = (nn.Linear(hidden, h * head_dim, bias=False) for h in (heads, kv_heads, kv_heads))
    o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
    x = torch.randn(s, hidden)
    x_shard = x.chunk(world)[rank]                                # [s/N, hidden]: this rank's tokens

    attn = UlyssesAttention(hidden, heads, kv_heads, group=None, mode="flash")   # fresh weights, or
    attn = UlyssesAttention.from_linears(q_proj, k_proj, v_proj, o_proj, heads, kv_heads, group=None)
    y_shard = attn(x_shard)       # [s/N, hidden] -> [s/N, hidden], causal over all s (position_ids=: RoPE)

    # the full block: causal grouped-query attention over the whole sequence
    q, k, v = (p(x).view(s, -1, head_dim).transpose(0, 1) for p in (q_proj, k_proj, v_proj))   # [heads, s, d]
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    y_full = o_proj(o.transpose(0, 1).reshape(s, heads * head_dim)).chunk(world)[rank]
    torch.testing.assert_close(y_shard, y_full, rtol=1e-5, atol=1e-5)   # fp32, other summation order
    if rank == 0:
        print(f"ulysses: Ulysses attention equals the full attention block on {world} ranks (fp32)")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()

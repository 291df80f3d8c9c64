"""Ulysses: both all-to-alls fused with the projections around attention, checked against the full attention block.

Run: torchrun --nproc-per-node 2 docs/examples/ulysses.py
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flashpar.dims import head_layout
from flashpar.models import LlamaConfig
from flashpar.models.parallel import ulysses_qkv_rows
from flashpar.overlap import all_to_all_matmul, matmul_all_to_all


def main(rank: int, world: int) -> None:
    cfg = LlamaConfig(hidden=32, heads=4, kv_heads=2)               # head_dim 8
    s, d = 8 * world, cfg.head_dim
    torch.manual_seed(0)                                          # every rank the same weights and input
    q_proj, k_proj, v_proj = (nn.Linear(cfg.hidden, h * d, bias=False)
                              for h in (cfg.heads, cfg.kv_heads, cfg.kv_heads))
    o_proj = nn.Linear(cfg.heads * d, cfg.hidden, bias=False)
    x = torch.randn(s, cfg.hidden)
    x_shard = x.chunk(world)[rank]                                # [s/N, hidden]: this rank's tokens

    hq, hk = head_layout(cfg.heads, cfg.kv_heads, world)          # this rank's query / kv heads
    w_qkv = torch.cat([q_proj.weight, k_proj.weight, v_proj.weight])[ulysses_qkv_rows(cfg, world)]  # by head group
    qkv = matmul_all_to_all(x_shard, w_qkv, group=None, mode="flash")   # [s, (hq + 2 hk) d]: every token
    q, k, v = (t.reshape(s, -1, d).transpose(0, 1) for t in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)   # this rank's heads
    y_shard = all_to_all_matmul(o.transpose(0, 1).reshape(s, hq * d), o_proj.weight, group=None, mode="flash")

    # the full block: causal grouped-query attention over the whole sequence
    q, k, v = (p(x).view(s, -1, d).transpose(0, 1) for p in (q_proj, k_proj, v_proj))   # [heads, s, d]
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    y_full = o_proj(o.transpose(0, 1).reshape(s, cfg.heads * d)).chunk(world)[rank]
    torch.testing.assert_close(y_shard, y_full, rtol=1e-5, atol=1e-5)   # fp32, other summation order
    if rank == 0:
        print(f"ulysses: Ulysses attention equals the full attention block on {world} ranks (fp32)")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()

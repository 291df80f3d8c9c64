"""Generation on a context-parallel mesh: packed prefill, a sharded KV cache, decode; checked against greedy
decoding of the single-process model.

Run: torchrun --nproc-per-node 2 docs/examples/generate.py
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from flashpar.infer import Sampling, generate
from flashpar.models import Llama, LlamaConfig
from flashpar.models.parallel import MESH_DIMS, ParallelLlama


def main(rank: int, world: int) -> None:
    cfg = LlamaConfig(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64)
    torch.manual_seed(0)                                          # every rank the same weights
    full = Llama(cfg)
    mesh = init_device_mesh("cpu", (1, world, 1, 1), mesh_dim_names=MESH_DIMS)   # (dp, cp, ulysses, tp)
    model = ParallelLlama(cfg, mesh, mode="auto", dp_mode="replicate")
    model.load_full(full)                                         # or model.load_hf_slices("path/to/hf_llama")

    prompts = [[5, 9, 2, 33, 7, 1, 12, 40, 3], [8, 8, 21]]       # packed as two documents, planned by FlashCP
    out = generate(model, prompts, max_new_tokens=4, sampling=Sampling())   # greedy; Sampling(temperature=...)

    for prompt, tokens in zip(prompts, out.tokens, strict=True):  # the single-process model, greedy, no cache
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(4):
                seq.append(int(full(torch.tensor(seq), [len(seq)])[-1].argmax()))
        assert list(tokens) == seq[len(prompt):], (tokens, seq[len(prompt):])
    if rank == 0:
        print(f"generated {out.tokens} on cp {world}: the single-process model's greedy tokens")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()

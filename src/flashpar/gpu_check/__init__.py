"""``make gpu-check`` (``python -m flashpar.gpu_check``): everything one CUDA GPU can tell, in one command.

A GPU is lent to this project now and then, for a few minutes; the CUDA paths are written against
the op schemas and the CPU tests.  This command spends such minutes on four parts, in order, each a
child process with its own hard time limit, so a hang or a crash costs one part, not the lease::

    part       what it runs                                                        limit (s)
    tests      pytest -m cuda: every CUDA-only test (the default backend, torch's      90
               fused SDPA kernels, and the varlen FlashAttention-2 backend against
               math, forward and backward; cp.attention on CUDA)
    attention  TFLOP/s of the CP segment-attention backends on real packs (shipped    150
               length lists, 32K-128K tokens, Llama-8B heads, bf16), forward and
               backward, against dense causal FlashAttention (SDPA) of the same
               useful FLOPs
    gemm       the GEMM efficiency lost by splitting a TP linear of an 8B model        60
               (hidden 4096, FFN 14336, 8192 tokens) into N = 2..8 row pieces
               written into slices of the output, TP 2, 4, 8, bf16
    train      flashpar train --device cuda at world size 1 (NCCL): --check, then     150
               20 steps; loss and tokens/s
                                                                                  ------
                                                                                     450

and writes ``gpu-check.json`` and ``gpu-check.md`` (and the parts' whole output, ``gpu-check.log``)
to ``$OUT`` when it is set, else ``runs/gpu-check``.  A part that fails, times out or crashes is
recorded with the tail of its output and the next part runs.

One GPU cannot host two NCCL ranks, so nothing here measures communication: every multi-rank
figure comes from ``flashpar simulate`` until a multi-GPU machine is available.

``--dry-run`` (``--device cpu --tiny``) runs every part's code at tiny sizes on the CPU (the CUDA
tests are reported as skipped, the kernels timed on the CPU, the trainer 2 steps on gloo), which is
what ``tests/test_gpu_check.py`` does before any GPU minute is spent.
"""

from flashpar.gpu_check.parts import PARTS, Part

__all__ = ["PARTS", "Part"]

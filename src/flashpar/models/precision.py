"""Mixed precision of ``ParallelLlama``: what computes, travels and is summed in which dtype.

``ParallelLlama(..., dtype=torch.bfloat16)`` (``flashpar train --dtype bf16``) runs the model as FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` does:

    parameters (master weights), AdamW and its state       fp32, as without mixed precision
    activations, from the embedding on                     bf16 (the tp / Ulysses / K/V transfers move bf16)
    weights in a GEMM                                      cast to bf16 by the layer; a ZeRO-3 layer casts
                                                           its dp rows BEFORE the dp all-gather (it moves bf16)
    RMSNorm statistics, rope angles, softmax, loss         fp32 (RMSNorm, the attention kernels' log-sum-exp
                                                           and merge, ``vocab_parallel_loss`` upcast)
    gradient of a weight                                   a bf16 GEMM on this rank's tokens, then fp32: the
                                                           cast's backward (tp / Ulysses layers) or
                                                           ``_ZeroLinear``'s fp32 gradient rows (ZeRO-3)
    every gradient sum across ranks                        fp32: the ZeRO-3 reduce-scatter over dp and
                                                           ``GradSync``'s all-reduces (``p.grad`` is fp32)

A cast to the parameter's own dtype returns the parameter itself, so ``dtype=torch.float32`` runs
the same code on the same tensors as a model without this option (bitwise the same results).

Error to expect (bf16: 8 significant bits, unit roundoff ``u = 2^-8 ~ 3.9e-3``; round to nearest,
so one rounding errs by at most ``u`` relative and by ``u / sqrt(3)`` rms).  A GEMM rounds its two
operands to bf16 and its output once (the kernels accumulate in fp32): ``y = sum_i w_i x_i (1 + d_i + e_i)``,
and for terms of random sign the operand errors add in quadrature like the terms themselves, so the
relative error of ``y`` is ~``sqrt(2/3) u`` from the operands plus ``u / sqrt(3)`` from the output, about
``u`` rms whatever the hidden size ``h`` (it does not grow like ``h`` or ``sqrt(h)``: the error sums over
the same terms as the value).  Attention: the kernels keep the scores, the softmax and the log-sum-exp
merge in fp32 and round the output once.  A weight's gradient passes some 25 to 50 such roundings on
the two-layer check models (about a dozen per block and direction: norm output, GEMMs, rope,
attention, silu and product, residual adds), independent, so its entries err by ``sqrt(25..50) u /
sqrt(3) ~ 3-4 u`` rms; measured (``max |a - b| / max |b|``, fp32 reference):
worst gradient 1.5e-2 = 3.8 u over the meshes of ``tests/test_precision.py`` (2.4-3.8 u per mesh), 1.2e-2
on ``flashpar train --check --dtype bf16`` (hidden 64, 2048 tokens), the loss <= 2.4e-5 (near ``log V``
it hardly depends on the logits).  The fp32 gradient sums add nothing visible (fp32 rounds 2^16 times finer).
"""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # --dtype's choices: the compute dtype

# One step of the mesh model against the single-process model (``flashpar train --check``): the worst
# relative error ``max |a - b| / max |b|`` of the loss and of each gradient.  fp32: the mesh only reorders
# sums (measured <= 6e-7).  bf16: the compute itself rounds (module docstring: ~3-4 u rms expected, 3.8 u
# the worst measured); 8 u = 3.1e-2 leaves a factor 2 for the tail of larger or deeper models (the error
# grows like the square root of the roundings on a path) and still fails a misplaced shard or a
# gradient not summed, O(1) errors, by a factor of 15 or more.
CHECK_TOL = {"fp32": 1e-4, "bf16": 8 * 2.0**-8}


def compute_dtype(name_or_dtype) -> torch.dtype:
    """The compute dtype of ``"fp32"`` / ``"bf16"`` or of a ``torch.dtype`` among them (ValueError: one line)."""
    if isinstance(name_or_dtype, torch.dtype) and name_or_dtype in DTYPES.values():
        return name_or_dtype
    if name_or_dtype in DTYPES:
        return DTYPES[name_or_dtype]
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name_or_dtype!r}")



def widened(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least fp32 (bf16 -> fp32; fp32 and a float64 model's float64 stay): the loss and the gathered
    vocabulary weight compute there."""
    return t.to(torch.promote_types(t.dtype, torch.float32))

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

Error to expect (bf16: 8 significant bits, unit roundoff ``u = 2^-8 ~ 3.9e-3``).  Every GEMM rounds its
operands to bf16 (relative error ``u`` each) and its output once (the kernels accumulate in fp32):
a dot product over ``h`` terms of random sign then errs by about ``u sqrt(2)`` relative to its typical
size (the operand roundings are independent and average like the terms), plus ``u`` from the output;
the residual stream adds one rounding per block.  A loss over thousands of targets averages these
errors (~``u`` relative at worst); a gradient is a sum over tokens of products of several rounded
factors, so its largest entry errs by a few ``u`` (measured in ``tests/test_precision.py``:
``CHECK_TOL["bf16"]`` is justified there against a float64 reference of the same weights).
"""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # --dtype's choices: the compute dtype

# One step of the mesh model against the single-process model (``flashpar train --check``): the worst
# relative error ``max |a - b| / max |b|`` of the loss and of each gradient.  fp32: the mesh only reorders
# sums (~1e-6 measured); bf16: the compute itself rounds (see the module docstring): ``2^-8`` is the unit
# roundoff, measured worst gradients ~5e-3 (loss ~5e-4) on the check's models, so 4 u = 1.6e-2 leaves a
# factor of ~3; a misplaced shard or a gradient not summed is O(1) either way.
CHECK_TOL = {"fp32": 1e-4, "bf16": 8 * 2.0**-8}


def compute_dtype(name_or_dtype) -> torch.dtype:
    """The compute dtype of ``"fp32"`` / ``"bf16"`` or of a ``torch.dtype`` among them (ValueError: one line)."""
    if isinstance(name_or_dtype, torch.dtype) and name_or_dtype in DTYPES.values():
        return name_or_dtype
    if name_or_dtype in DTYPES:
        return DTYPES[name_or_dtype]
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name_or_dtype!r}")


def name_of(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)

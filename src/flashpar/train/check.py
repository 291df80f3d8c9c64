"""``flashpar train --check``: the mesh model against the single-process model after one step.

Every rank builds the same single-process ``Llama`` (one seed) and the same ``M x dp`` packed
sequences (``M`` micro-batches per dp rank; ``sequences[m * dp + d]`` is dp rank ``d``'s micro-batch
``m``, as in the trainer).  The reference loss and gradients come from that model on all sequences,
the loss normalised by the global number of targets; with ``clip_ratio`` its gradients are then
clipped by ``torch.nn.utils.clip_grad_norm_`` to ``clip_ratio`` times their float64 norm (a ratio
below 1 always clips).  The mesh model takes its shards of the same weights, its dp rank's
micro-batches, their cp shards (the plans the trainer makes: ``planner_cost`` on the device) and its
ulysses and tp rows, and runs the trainer's step without the optimizer
(``flashpar.train.step.gradients``: the micro-batches' gradients accumulated, summed over copies once,
the global norm, clipping).  Its loss (summed over ranks),
gradient norm and every gradient (tp shards gathered) are compared with the reference: relative
error ``max |a - b| / max |b|``.

    one_step = _reference (model, loss, norm, clipped gradients)
             + _mesh_step (the mesh model from the reference's weights: loss, norm, gradients)
             + _errors
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

from flashpar import cp
from flashpar.dims import ParallelDims
from flashpar.links import planning_device
from flashpar.models import Llama, LlamaConfig, load_hf, next_token_loss
from flashpar.models.layout import LAYOUT, label_of
from flashpar.models.parallel import ParallelLlama
from flashpar.options import ParallelOptions
from flashpar.train.planning import group_figures, planner_cost
from flashpar.train.step import MicroBatch, gradients

TOL = 1e-4  # fp32: the mesh only reorders sums (~1e-6 relative); one misplaced shard is O(1)
CHECK_CLIP_RATIO = 0.5  # --check clips the gradients to half their norm: the coefficient is exercised (~0.5)
NORM = "grad norm"  # the row of the global gradient norm (before clipping)


def one_step(cfg: LlamaConfig, mesh, sequences, options: ParallelOptions | None = None, *, strategy: str,
             seed: int = 0, micro_batches: int = 1, clip_ratio: float | None = None, init_from: str | None = None,
             device: torch.device | None = None, reference_dtype: torch.dtype = torch.float32,
             **settings) -> dict[str, float]:
    """Relative errors of the loss, of the gradient norm (with ``clip_ratio``) and of every parameter's
    gradient after clipping (names of the single-process model), the mesh model run with ``options``
    (``flashpar.options.ParallelOptions``; none given: its defaults, any of its fields given by name in
    ``settings`` changed: the trainer's ``--dtype``, ``--regather`` ...; the reference stays the fp32
    single-process model, on the CPU).  ``sequences``: ``micro_batches x dp`` ``(tokens, labels, doc_lens)``, dp
    rank ``d``'s micro-batch ``m`` at ``m * dp + d``.  ``init_from``: the weights of that Hugging Face folder
    (the reference ``load_hf``, the mesh model its slices: ``ParallelLlama.load_hf_slices``) instead of seeded
    ones.  ``device``: the mesh model's (its mesh's device type: NCCL reduces device tensors only; None: the
    CPU).  ``reference_dtype``: the single-process step's dtype (``torch.float64``: the weights are the same fp32
    values, every product and sum of the reference exact to fp32's rounding)."""
    options = options or ParallelOptions()
    if settings:
        options = options.replace(**settings)
    dp = mesh["dp"].size()
    if len(sequences) != micro_batches * dp:
        raise ValueError(f"one_step: {len(sequences)} sequences for {micro_batches} micro-batches x dp = {dp}")
    torch.manual_seed(seed)
    ref = load_hf(init_from, dtype=torch.float32) if init_from else Llama(cfg)
    wide = ref if reference_dtype == torch.float32 else copy.deepcopy(ref).to(reference_dtype)
    want = _reference(wide, sequences, clip_ratio)
    got = _mesh_step(ref, cfg, mesh, sequences, options, strategy=strategy, micro_batches=micro_batches,
                     clip=want["clip"], init_from=init_from, device=device)
    return _errors(got, want, wide, clipped=clip_ratio is not None)


def _reference(ref: Llama, sequences, clip_ratio: float | None) -> dict:
    """The single-process step: loss over every sequence (normalised by all their targets), backward, the
    gradient's float64 norm from the full tensors, then ``clip_grad_norm_`` to ``clip_ratio`` x that norm."""
    count = sum(int((lab != -100).sum()) for _, lab, _ in sequences)
    loss = sum(next_token_loss(ref(tok, lens), lab, count) for tok, lab, lens in sequences)
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in ref.parameters()))
    clip = 0.0
    if clip_ratio is not None:
        clip = clip_ratio * norm
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    return {"loss": float(loss.detach()), "norm": norm, "count": count, "clip": clip}


def _mesh_step(ref: Llama, cfg: LlamaConfig, mesh, sequences, options: ParallelOptions, *, strategy: str,
               micro_batches: int, clip: float, init_from: str | None = None,
               device: torch.device | None = None) -> dict:
    """The mesh model with ``ref``'s weights, through ``gradients`` on this rank's micro-batches: the loss
    summed over ranks, the global norm and the full gradients (collective)."""
    model = ParallelLlama(cfg, mesh, options)
    if init_from:
        model.load_hf_slices(init_from)  # the same weights as ref, read by this rank's slices
    else:
        model.load_full(ref)
    device = device or torch.device("cpu")
    model.to(device)
    dp, d, c = mesh["dp"].size(), mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    count = sum(int((lab != -100).sum()) for _, lab, _ in sequences)
    hw, burst = planning_device(device.type, mesh.size() // (mesh["dp"].size() * mesh["cp"].size()))  # tp x U
    hw = group_figures(hw, ParallelDims.of_mesh(mesh), ("cp",), device.type)
    cost = planner_cost(cfg, options.dtype_bytes, hardware=hw, burst=burst)  # the trainer's plans
    batch = []
    for m in range(micro_batches):
        tokens, labels, doc_lens = sequences[m * dp + d]
        plan = cp.plan(doc_lens, mesh["cp"].size(), strategy=strategy, cost=cost)
        batch.append(MicroBatch(cp.shard(tokens, plan, c).to(device), cp.shard(labels, plan, c).to(device), plan))
    loss, norm = gradients(model, batch, count, clip=clip)
    total = loss.clone()
    dist.all_reduce(total)
    return {"loss": float(total), "norm": float(norm), "grads": model.full_grads()}


def _errors(got: dict, want: dict, ref: Llama, *, clipped: bool) -> dict[str, float]:
    errors = {"loss": abs(got["loss"] - want["loss"]) / abs(want["loss"])}
    if clipped:
        errors[NORM] = abs(got["norm"] - want["norm"]) / want["norm"]
    grads = dict(ref.named_parameters())
    for name, g in got["grads"].items():
        w = grads[name].grad
        errors[name] = float((g.to(w) - w).abs().max() / w.abs().max().clamp_min(1e-12))
    return errors


def by_group(errors: dict[str, float], tol: float = TOL) -> list[tuple[str, float, bool]]:
    """``(group, worst relative error, passed)`` per parameter group, the loss (and the gradient norm) first;
    the groups are the rows of ``flashpar.models.layout.LAYOUT``, in its order.  A NaN error is the worst
    and fails.  ``tol``: the bound (``flashpar.models.precision.CHECK_TOL`` of the run's dtype)."""
    found: dict[str, list[float]] = {}
    for name, err in errors.items():
        if name not in ("loss", NORM):
            found.setdefault(label_of(name), []).append(err)
    rows = [(k, [errors[k]]) for k in ("loss", NORM) if k in errors]
    rows += [(lay.label, found[lay.label]) for lay in LAYOUT.values() if lay.label in found]
    return [(label, _worst(errs), all(e <= tol for e in errs)) for label, errs in rows]


def _worst(errs: list[float]) -> float:
    return next((e for e in errs if math.isnan(e)), max(errs))

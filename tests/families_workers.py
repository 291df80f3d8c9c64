"""Per-rank bodies of tests/test_families.py: the parallel model of each family feature in float64 against the
single-process model (run by dist_harness)."""

from __future__ import annotations

import dataclasses
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from flashpar import cp
from flashpar.models import Llama, LlamaConfig
from flashpar.models.llama import next_token_loss
from flashpar.models.parallel import MESH_DIMS, ParallelLlama
from flashpar.models.rope_scaling import LinearScaling, YarnScaling
from train_workers import sequences

BASE = LlamaConfig(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48)
QWEN3 = dataclasses.replace(BASE, family="qwen3", qk_norm=True, head_dim=12)  # head_dim apart from hidden / heads
FAMILY_MODELS = {  # a case's model, by name
    "qwen2": dataclasses.replace(BASE, family="qwen2", qkv_bias=True, tie_embeddings=False),
    "qwen3": QWEN3,
    "qwen3-bias": dataclasses.replace(QWEN3, qkv_bias=True, o_bias=True, tie_embeddings=False),
    "llama-mlp-bias": dataclasses.replace(BASE, qkv_bias=True, o_bias=True, mlp_bias=True),
    "yarn": dataclasses.replace(BASE, rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=16),
                                rope_theta=500.0),
    "yarn-mscale": dataclasses.replace(BASE, rope_scaling=YarnScaling(
        factor=8.0, original_max_position_embeddings=8, beta_fast=8.0, mscale=1.2, mscale_all_dim=0.8,
        truncate=False)),
    "linear": dataclasses.replace(BASE, rope_scaling=LinearScaling(factor=3.0)),
    "vocab61": dataclasses.replace(BASE, vocab_size=61, kv_heads=4, family="qwen2", qkv_bias=True),  # prime: pads
    "vocab61-untied": dataclasses.replace(BASE, vocab_size=61, tie_embeddings=False),
    "vocab7": dataclasses.replace(BASE, vocab_size=7, kv_heads=4),  # fewer rows than tokens: gathered weight
    "heads6-vocab13": dataclasses.replace(QWEN3, hidden=48, heads=6, kv_heads=3, ffn=72, vocab_size=13,
                                          qkv_bias=True, o_bias=True),
    # sliding windows shorter than most documents (1-30 tokens): every layer (Mistral), and a full layer beside a
    # windowed one sharing one plan (Qwen's max_window_layers)
    "mistral-w5": dataclasses.replace(BASE, family="mistral", windows=(5, 5), max_positions=64),
    "qwen2-mixed": dataclasses.replace(BASE, family="qwen2", qkv_bias=True, windows=(0, 7), max_positions=64),
}


def randomized(cfg: LlamaConfig, seed: int) -> Llama:
    """The float64 single-process model with every parameter random (norm gains around 1, biases around 0), so
    that a bias or a norm weight in the wrong place shows."""
    torch.manual_seed(seed)
    model = Llama(cfg).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return model


def float64_step(cfg: LlamaConfig, shape, dp_mode: str, *, seed: int = 0) -> dict[str, float]:
    """The loss and every gradient of the mesh model (float64 parameters and compute) on mesh ``shape`` against the
    float64 single-process model, as ``{name: max |a - b| / max |b|}`` (the loss: relative error)."""
    ref = randomized(cfg, seed)
    seqs = sequences(shape[0], seed=seed, vocab=cfg.vocab_size)
    count = sum(int((lab != -100).sum()) for _, lab, _ in seqs)
    want = sum(next_token_loss(ref(tok, lens), lab, count) for tok, lab, lens in seqs)
    want.backward()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIMS)
    # the trainer's compute dtypes are fp32 / bf16; this check computes in float64, its parameters made float64
    # (ZeRO-3's units gather in the compute dtype and sum gradients in the parameters' dtype)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with mock.patch("flashpar.models.parallel.compute_dtype", lambda _: torch.float64):
            model = ParallelLlama(cfg, mesh, dp_mode=dp_mode)
    finally:
        torch.set_default_dtype(default)
    model.load_full(ref)
    d, c = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    tokens, labels, doc_lens = seqs[d]
    plan = cp.plan(doc_lens, mesh["cp"].size(), strategy="flashcp")
    loss = model(cp.shard(tokens, plan, c), plan, cp.shard(labels, plan, c), count)
    loss.backward()
    model.reduce_grads()
    total = loss.detach().clone()
    dist.all_reduce(total)
    errors = {"loss": float((total - want.detach()).abs() / want.detach().abs())}
    grads = dict(ref.named_parameters())
    for name, g in model.full_grads().items():
        w = grads[name].grad
        errors[name] = float((g - w).abs().max() / w.abs().max().clamp_min(1e-300))
    missing = sorted(set(grads) - set(errors))
    if missing:
        errors[f"missing {missing}"] = float("inf")
    return errors


def float64_cases(rank, world, cases):
    """``float64_step`` for each ``(shape, dp_mode, model)`` of ``cases`` in one spawn."""
    return [float64_step(FAMILY_MODELS[model], shape, dp_mode) for shape, dp_mode, model in cases]


def randomize_features(model, seed: int) -> None:
    """A transformers model's norm gains around 1 and biases around 0, at random (``seed``), so that each family
    feature shows in the logits (transformers initialises them to exactly 1 and 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif n.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))

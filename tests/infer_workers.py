"""Per-rank bodies of the inference tests (run by dist_harness.run_ranks): prefill logits and caches, decode
logits and generated tokens on (tp, cp) meshes, against float64 single-process references."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from flashpar import cp
from flashpar.models import Llama, LlamaConfig
from flashpar.models.llama import document_positions, rope
from flashpar.models.parallel import MESH_DIMS, ParallelLlama

PROMPT_LENS = [40, 5, 9, 3, 17]  # flashcp (default cost model) splits the 40 at cp 2 and 3, keeps the rest whole
MAX_NEW = 6


def prompts(lens=PROMPT_LENS, vocab: int = 64, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


def reference(model: Llama, tokens: torch.Tensor, doc_lens) -> tuple[torch.Tensor, list, list]:
    """The single-process model's logits ``[T, V]`` and each layer's rotated K and V ``[T, H_kv, D]`` (the
    model's dtype: float64 for the references)."""
    cfg = model.cfg
    positions = document_positions(doc_lens)
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
    t = torch.arange(tokens.shape[0])
    mask = (doc[:, None] == doc[None, :]) & (t[None, :] <= t[:, None])
    ks, vs = [], []
    with torch.no_grad():
        x = model.embed(tokens)
        for block in model.blocks:
            a = block.attn_norm(x)
            ks.append(rope(block.k_proj(a).view(-1, cfg.kv_heads, cfg.head_dim), positions, cfg))
            vs.append(block.v_proj(a).view(-1, cfg.kv_heads, cfg.head_dim))
            x = block(x, positions, mask)
        logits = F.linear(model.norm(x), model.head_weight())
    return logits, ks, vs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def build(shape, full: Llama, mode: str = "flash") -> ParallelLlama:
    """The parallel model on mesh (tp, cp) = ``shape`` with ``full``'s weights (replicated over cp)."""
    tp, cpn = shape
    mesh = init_device_mesh("cpu", (1, cpn, 1, tp), mesh_dim_names=MESH_DIMS)
    model = ParallelLlama(full.cfg, mesh, mode=mode, dp_mode="replicate", timeout=300.0)  # 6 ranks on a loaded box
    model.load_full(full)
    return model


def _model(source) -> Llama:
    """A float32 model: a Hugging Face folder, or a seeded ``Llama`` of a ``LlamaConfig``."""
    if isinstance(source, LlamaConfig):
        torch.manual_seed(0)
        return Llama(source)
    from flashpar.models.hf import load_hf

    return load_hf(source)


def prefill_case(rank, world, shape, source, strategy):
    """Prefill of ``prompts()`` on mesh ``shape``: ``(logits relative error, worst cache relative error over
    layers / K / V, prompts split, prompts whole, cache tokens here)`` against the float64 model."""
    from flashpar.infer.cache import RankCache, cache_schedule
    from flashpar.infer.prefill import prefill

    full = _model(source)
    ids = prompts(vocab=full.cfg.vocab_size)
    lens = [len(p) for p in ids]
    tokens = torch.tensor(sum(ids, []))
    ref_logits, ref_k, ref_v = reference(full.double(), tokens, lens)
    model = build(shape, full.float())
    plan = cp.plan(lens, shape[1], strategy=strategy, cost=cp.CostModel())
    schedule = cache_schedule(plan, 0)
    cache = RankCache(plan, schedule, model.cp_rank, full.cfg.layers, model.blocks[0].kv_heads, full.cfg.head_dim,
                      torch.float32, torch.device("cpu"))
    logits = prefill(model, cp.shard(tokens, plan, model.cp_rank), plan, cache)
    last = torch.tensor(lens).cumsum(0) - 1
    err_logits = _rel(logits, ref_logits[last])
    local = plan.local_indices(model.cp_rank)
    hk = model.blocks[0].kv_heads
    heads = slice(model.tp_rank * hk, (model.tp_rank + 1) * hk)
    err_cache = max(max(_rel(cache.k[i][cache.prefill_slots], ref_k[i][local][:, heads]),
                        _rel(cache.v[i][cache.prefill_slots], ref_v[i][local][:, heads]))
                    for i in range(full.cfg.layers))
    split = len(schedule.split())
    return err_logits, err_cache, split, len(lens) - split, int(local.numel())


def decode_case(rank, world, shape, source, strategy):
    """Prefill, then ``MAX_NEW - 1`` greedy decode steps by hand: the worst relative error of every step's logits
    against the float64 model run on the whole sequence (prompt + tokens so far), the greedy tokens, and whether
    each rank's appended K/V sit where the schedule says (fewest cached of the group)."""
    from flashpar.infer.cache import RankCache, cache_schedule
    from flashpar.infer.decode import decode_step
    from flashpar.infer.prefill import prefill

    full = _model(source)
    ref_model = _model(source).double()
    ids = prompts(vocab=full.cfg.vocab_size)
    lens = [len(p) for p in ids]
    model = build(shape, full)
    plan = cp.plan(lens, shape[1], strategy=strategy, cost=cp.CostModel())
    schedule = cache_schedule(plan, MAX_NEW - 1)
    cache = RankCache(plan, schedule, model.cp_rank, full.cfg.layers, model.blocks[0].kv_heads, full.cfg.head_dim,
                      torch.float32, torch.device("cpu"))
    tokens = torch.tensor(sum(ids, []))
    logits = prefill(model, cp.shard(tokens, plan, model.cp_rank), plan, cache)
    rows = torch.tensor(cache.rows, dtype=torch.long)
    seqs = [list(p) for p in ids]
    worst = _rel(logits, reference(ref_model, tokens, lens)[0][torch.tensor(lens).cumsum(0) - 1])
    current = logits.argmax(-1)
    for p in range(len(ids)):
        seqs[p].append(int(current[p]))
    positions = torch.tensor([lens[p] for p in cache.rows])
    for s in range(MAX_NEW - 1):
        step_logits = decode_step(model, cache, current[rows], positions + s, s)
        cur_lens = [len(q) for q in seqs]
        ref = reference(ref_model, torch.tensor(sum(seqs, [])), cur_lens)[0][torch.tensor(cur_lens).cumsum(0) - 1]
        worst = max(worst, _rel(step_logits, ref[rows]))
        # every rank takes the float64 reference's greedy token (the test asserts the logits are close, so the
        # ranks stay on the same sequences as the reference whatever a near-tie would do)
        current = ref.argmax(-1)
        for p in range(len(ids)):
            seqs[p].append(int(current[p]))
    held = [cache.lens[i].item() for i in range(len(cache.rows))]
    want = [schedule.held[model.cp_rank][p] + sum(st[p] == model.cp_rank for st in schedule.appends)
            for p in cache.rows]
    return worst, held == want, len(schedule.split())


def generate_case(rank, world, shape, source, strategy, sampling, lens=None):
    """``flashpar.infer.generate`` on mesh ``shape`` for ``prompts(lens)``: the tokens of every prompt, and this
    rank's K/V bytes and tokens."""
    from flashpar.infer import Sampling, generate

    full = _model(source)
    model = build(shape, full)
    ids = prompts(lens or PROMPT_LENS, vocab=full.cfg.vocab_size)
    how = Sampling(**sampling)
    out = generate(model, ids, max_new_tokens=MAX_NEW, sampling=how, strategy=strategy, cost=cp.CostModel())
    return out.tokens, out.kv_bytes, out.kv_tokens


def cases(rank, world, fn, items):
    return [fn(rank, world, *item) for item in items]


def bad_input(rank, world, shape, source, kind):
    """The one line every rank raises for a bad input of ``kind`` (only rank 0's input is bad for
    ``'one rank'``)."""
    from flashpar.infer import generate

    full = _model(source)
    model = build(shape, full)
    ids = prompts(vocab=full.cfg.vocab_size)
    max_new = MAX_NEW
    if kind == "empty":
        ids[1] = []
    elif kind == "vocab":
        ids[2][0] = full.cfg.vocab_size
    elif kind == "long":
        max_new = full.cfg.max_positions
    elif kind == "one rank" and rank == 0:
        ids[0][0] = -1
    try:
        generate(model, ids, max_new_tokens=max_new, cost=cp.CostModel())
    except (ValueError, RuntimeError) as err:
        return str(err)
    return None


def save_checkpoint(rank, world, path, cfg, tokenizer=None):
    """A flashpar training checkpoint of ``build``'s seeded model (no step taken) at ``path``, of a run with
    ``tokenizer`` (its meta.json records it): what ``flashpar generate --checkpoint`` reads."""
    from flashpar.train.checkpoint import save
    from flashpar.train.config import TrainConfig
    from flashpar.train.step import build

    config = TrainConfig(nproc=1, dp=1, cp=1, tp=1, model=cfg, timeout=60.0, dp_mode="replicate", tokenizer=tokenizer)
    mesh = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=MESH_DIMS)
    _, model, opt = build(config, mesh, torch.device("cpu"))
    save(path, model, opt, 1, config)
    return True


def options_case(rank, world, shape, source, sampling, stop_ids):
    """``flashpar.infer.generate`` of ``prompts()`` on mesh ``shape`` with ``Sampling(**sampling)``, ``stop_ids``
    and log-probabilities: every output's tokens, finish reason and log-probabilities."""
    from flashpar.infer import Sampling, generate

    full = _model(source)
    model = build(shape, full)
    ids = prompts(vocab=full.cfg.vocab_size)
    out = generate(model, ids, max_new_tokens=MAX_NEW, sampling=Sampling(**sampling), stop_ids=stop_ids,
                   logprobs=True, cost=cp.CostModel())
    return out.tokens, out.finish_reasons, out.logprobs

"""``generate(model, prompts, ...)``: prefill the batch packed over the mesh, then decode one token per prompt
per step until ``max_new_tokens`` or the end-of-text token.

    plan      = cp.plan(lens, cp, cost=forward-only cost model)           (flashpar.infer.planning)
    schedule  = where each decode step's K/V goes (fewest cached of the prompt's group)
    logits_0  = prefill(...)                 -> token 1 of every prompt   (time to first token)
    logits_s  = decode_step(token s)         -> token s + 1, s = 1 .. N-1

Every rank of the mesh calls it with the same prompts and settings (checked: one exchange of a few integers;
a bad prompt or a disagreement raises one line on every rank, before any other communication).  A cp rank
decodes the prompts it holds K/V of; the chosen tokens are gathered once, at the end (and, with an
end-of-text token, every ``STOP_EVERY`` steps one flag says whether every prompt has ended).
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field

import torch

from flashpar import cp
from flashpar.dist import exchange_metadata
from flashpar.infer.cache import RankCache, cache_schedule
from flashpar.infer.comm import all_reduce
from flashpar.infer.decode import decode_step
from flashpar.infer.prefill import prefill
from flashpar.infer.sampling import Sampling, choose, uniforms

OP = "flashpar.infer.generate"
STOP_EVERY = 16  # decode steps between two checks that every prompt has ended (a host read each)


@dataclass
class Generation:
    """What ``generate`` returns (the same on every rank): the new ``tokens`` of each prompt (ending with the
    end-of-text token where one was met), the prompt lengths, the timings and this rank's cache figures."""

    tokens: list[list[int]]
    prompt_tokens: list[int]
    ttft_s: float
    decode_s: float
    decode_steps: int
    kv_bytes: int  # K/V this rank holds at the end (its tokens x its heads x every layer)
    kv_tokens: int
    plan: cp.CPPlan = field(repr=False)
    first_logits: torch.Tensor | None = field(default=None, repr=False)  # [prompts, V] of the prefill

    @property
    def prefill_tokens_per_s(self) -> float:
        return sum(self.prompt_tokens) / self.ttft_s if self.ttft_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return len(self.tokens) * self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0


def check_prompts(prompts, cfg, max_new_tokens: int) -> list[list[int]]:
    """The prompts as lists of ints, or ``ValueError`` naming the first bad one."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"{OP}: max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not prompts:
        raise ValueError(f"{OP}: no prompts")
    out = []
    for i, p in enumerate(prompts):
        ids = p.tolist() if isinstance(p, torch.Tensor) else list(p)
        if not ids:
            raise ValueError(f"{OP}: prompt {i} is empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"{OP}: prompt {i} holds something other than integer token ids")
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"{OP}: prompt {i} has token id {bad[0]} outside the vocabulary [0, {cfg.vocab_size})")
        if len(ids) + max_new_tokens > cfg.max_positions:
            raise ValueError(f"{OP}: prompt {i} has {len(ids)} tokens; with {max_new_tokens} new ones that exceeds the "
                             f"model's {cfg.max_positions} positions")
        out.append(ids)
    return out


def check_model(model) -> None:
    if model.ulysses > 1:
        raise ValueError(f"{OP}: ulysses = {model.ulysses}: decode splits heads over tp only (use --tp)")
    if model.prefetcher is not None:
        raise ValueError(f"{OP}: the model keeps ZeRO-3 rows; build it with dp_mode='replicate' for inference")
    if model.dp > 1:
        raise ValueError(f"{OP}: dp = {model.dp}: a batch is packed over cp; build the mesh with dp 1")


def _agree(model, prompts, how: Sampling, max_new_tokens: int, eos_id, error) -> None:
    """One exchange over the mesh: every rank raises if any rank's input is bad or the ranks' inputs differ."""
    values = []
    if error is None:
        text = repr((prompts, how, max_new_tokens, eos_id))
        values = [zlib.crc32(text.encode()) & 0x7FFFFFFF]
    table = exchange_metadata(model.step_check.info, values, device=torch.device("cpu"), op_name=OP,
                              local_error=error, timeout_s=model.step_check.timeout_s)
    column = table[:, 0].tolist()
    if len(set(column)) > 1:
        raise ValueError(f"{OP}: ranks were given different prompts or settings (digests {column}, rank order)")


def generate(model, prompts, *, max_new_tokens: int = 16, sampling: Sampling | None = None, eos_id: int | None = None,
             strategy: str = "flashcp", cost=None, progress: bool = False, keep_logits: bool = False) -> Generation:
    """Generate for ``prompts`` (lists or 1-D tensors of token ids) with the ``ParallelLlama`` ``model`` (every
    rank of its mesh calls this with the same arguments).  ``cost``: the planner's cost model (default: the
    model's shape, the devices' figures, weighted for a forward alone: ``flashpar.infer.planning``)."""
    how = sampling or Sampling()
    error, ids = None, []
    try:
        check_model(model)
        ids = check_prompts(prompts, model.cfg, max_new_tokens)
        if eos_id is not None and not (isinstance(eos_id, int) and 0 <= eos_id < model.cfg.vocab_size):
            raise ValueError(f"{OP}: eos_id {eos_id!r} is not a token id of the vocabulary")
    except ValueError as err:
        error = err
    _agree(model, ids, how, max_new_tokens, eos_id, error)
    device = model.embed.weight.device
    if cost is None:
        from flashpar.infer.planning import forward_cost

        cost = forward_cost(model.cfg, model.options.dtype_bytes, device.type, model.tp)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    lens = [len(p) for p in ids]
    first = first_token(model, ids, how, max_new_tokens, strategy, cost)
    sync()
    ttft = time.perf_counter() - t0
    plan, cache, rows, u, out, logits = first.plan, first.cache, first.rows, first.u, first.out, first.logits
    positions = torch.tensor([lens[p] for p in cache.rows], dtype=torch.long, device=device)
    done = out[:, 0] == eos_id if eos_id is not None else None
    steps = max_new_tokens - 1
    bar = _progress(steps) if progress and steps else None
    t1, ran = time.perf_counter(), 0
    for s in range(steps):
        step_logits = decode_step(model, cache, out[:, s], positions + s, s)
        out[:, s + 1] = choose(step_logits, u[s + 1], how)
        ran = s + 1
        if bar is not None:
            bar.update(1)
        if done is not None:
            done |= out[:, s + 1] == eos_id
            if ran % STOP_EVERY == 0 and _all_ended(model, done):
                break
    sync()
    decode_s = time.perf_counter() - t1
    if bar is not None:
        bar.close()
    full = torch.full((len(ids), max_new_tokens), -1, dtype=torch.long, device=device)
    full.index_copy_(0, rows, out)
    full = all_reduce(full, model.cp_group, plan.cp_size, op=torch.distributed.ReduceOp.MAX).cpu()
    result = []
    for row in full[:, : ran + 1].tolist():
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id) + 1]
        result.append(row)
    held = cache.tokens()
    return Generation(result, lens, ttft, decode_s, ran, held * cache.bytes_per_token(), held, plan,
                      logits if keep_logits else None)


@dataclass
class Started:
    """What the time to first token makes: the ``plan``, this rank's ``cache``, its ``rows`` (``cache.rows`` on
    the device), their uniform numbers ``u [max_new_tokens, rows]``, the chosen tokens ``out [rows,
    max_new_tokens]`` (column 0 filled: the first token) and the prefill's ``logits [prompts, V]``."""

    plan: cp.CPPlan
    cache: RankCache
    rows: torch.Tensor
    u: torch.Tensor
    out: torch.Tensor
    logits: torch.Tensor


def first_token(model, ids: list[list[int]], how: Sampling, max_new_tokens: int, strategy: str, cost) -> Started:
    """The time to first token of checked prompts ``ids``: planning, the cache's set-up, the prefill and the first
    choice (every rank of the mesh calls it with the same arguments)."""
    plan = cp.plan([len(p) for p in ids], model.mesh["cp"].size(), strategy=strategy, cost=cost)
    cache, rows, u, out, tokens_cp = set_up(model, ids, plan, how, max_new_tokens)
    logits = prefill(model, tokens_cp, plan, cache)
    out[:, 0] = choose(logits.index_select(0, rows), u[0], how)
    return Started(plan, cache, rows, u, out, logits)


def set_up(model, ids: list[list[int]], plan: cp.CPPlan, how: Sampling, max_new_tokens: int):
    """``(cache, rows, u, out, tokens_cp)`` of ``Started`` for ``plan``, and this cp rank's prompt tokens."""
    device, cfg = model.embed.weight.device, model.cfg
    schedule = cache_schedule(plan, max_new_tokens - 1)
    cache = RankCache(plan, schedule, model.cp_rank, cfg.layers, model.blocks[0].kv_heads, cfg.head_dim,
                      model.compute_dtype, device)
    rows = torch.tensor(cache.rows, dtype=torch.long, device=device)
    u = uniforms(how.seed, max_new_tokens, len(ids)).to(device)[:, rows]  # [steps, rows]
    out = torch.zeros(len(cache.rows), max_new_tokens, dtype=torch.long, device=device)
    tokens = torch.cat([torch.tensor(p, dtype=torch.long) for p in ids]).to(device)
    return cache, rows, u, out, cp.shard(tokens, plan, model.cp_rank)


def _all_ended(model, done: torch.Tensor) -> bool:
    """Whether every prompt of every rank has ended (one small all-reduce over the mesh, read on the host)."""
    flag = torch.tensor([0 if bool(done.all()) else 1], dtype=torch.long)
    torch.distributed.all_reduce(flag, group=model.step_check.info.group)
    return int(flag) == 0


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="decode", unit="step", dynamic_ncols=True)

"""``generate(model, prompts, ...)``: prefill the batch packed over the mesh, then decode one token per output
per step until ``max_new_tokens`` or every output has ended (``flashpar.infer.stopping``).

    plan      = cp.plan(lens, cp, cost=forward-only cost model)           (flashpar.infer.planning)
    schedule  = where each decode step's K/V goes (fewest cached of the prompt's group)
    logits_0  = prefill(...)                 -> token 1 of every prompt   (time to first token)
    logits_s  = decode_step(token s)         -> token s + 1, s = 1 .. N-1

``sampling.n`` outputs per prompt are ``n`` copies of the prompt in the batch (output ``i * n + j``: prompt ``i``'s
sample ``j``), each with its own uniform numbers.  Every rank of the mesh calls it with the same prompts and
settings (checked: one exchange of a few integers; a bad prompt or a disagreement raises one line on every rank,
before any other communication).  A cp rank decodes the outputs it holds K/V of; the chosen tokens (and their
log-probabilities) are gathered once, at the end.  Where something can end an output (an end-of-text or stop
token, a stop string), every ``STOP_EVERY`` steps one flag says whether every output has ended: the one read on
the host, where the stop strings are looked for too.
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
from flashpar.infer.penalties import History
from flashpar.infer.prefill import prefill
from flashpar.infer.sampling import Sampling, choose, uniforms
from flashpar.infer.stopping import Stopping, check_stopping, finish, stop_string_end

OP = "flashpar.infer.generate"
STOP_EVERY = 16  # decode steps between two checks that every output has ended (a host read each)


@dataclass
class Generation:
    """What ``generate`` returns (the same on every rank): the new ``tokens`` of each output (``n`` per prompt,
    prompt by prompt; ending with the end-of-text or stop token where one was met), why each ended
    (``finish_reasons``: "eos", "stop" or "length"), their ``texts`` (with ``decode``) and ``logprobs`` (with
    ``logprobs=True``), the prompt lengths, the timings and this rank's cache figures."""

    tokens: list[list[int]]
    prompt_tokens: list[int]
    ttft_s: float
    decode_s: float
    decode_steps: int
    kv_bytes: int  # K/V this rank holds at the end (its tokens x its heads x every layer)
    kv_tokens: int
    plan: cp.CPPlan = field(repr=False)
    first_logits: torch.Tensor | None = field(default=None, repr=False)  # [outputs, V] of the prefill
    finish_reasons: list[str] = field(default_factory=list)
    texts: list[str] | None = None
    logprobs: list[list[float]] | None = None
    n: int = 1

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.n * sum(self.prompt_tokens) / self.ttft_s if self.ttft_s > 0 else 0.0

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


def _agree(model, prompts, how: Sampling, max_new_tokens: int, stopping: Stopping, logprobs: bool, error) -> None:
    """One exchange over the mesh: every rank raises if any rank's input is bad or the ranks' inputs differ."""
    values = []
    if error is None:
        text = repr((prompts, how, max_new_tokens, stopping, logprobs))
        values = [zlib.crc32(text.encode()) & 0x7FFFFFFF]
    table = exchange_metadata(model.step_check.info, values, device=torch.device("cpu"), op_name=OP,
                              local_error=error, timeout_s=model.step_check.timeout_s)
    column = table[:, 0].tolist()
    if len(set(column)) > 1:
        raise ValueError(f"{OP}: ranks were given different prompts or settings (digests {column}, rank order)")


def generate(model, prompts, *, max_new_tokens: int = 16, sampling: Sampling | None = None, eos_id: int | None = None,
             strategy: str = "flashcp", cost=None, progress: bool = False, keep_logits: bool = False,
             stop_ids=(), stop=(), decode=None, logprobs: bool = False) -> Generation:
    """Generate for ``prompts`` (lists or 1-D tensors of token ids) with the ``ParallelLlama`` ``model`` (every
    rank of its mesh calls this with the same arguments).  ``cost``: the planner's cost model (default: the
    model's shape, the devices' figures, weighted for a forward alone: ``flashpar.infer.planning``).
    ``eos_id``, ``stop_ids``, ``stop``: what ends an output (``flashpar.infer.stopping``; stop strings are read
    through ``decode``, ids -> text, which also gives ``Generation.texts``).  ``logprobs``: each chosen token's
    log-probability (``flashpar.infer.sampling``)."""
    how = sampling or Sampling()
    stopping = Stopping(eos_id, tuple(stop_ids), tuple(stop))
    error, ids = None, []
    try:
        check_model(model)
        ids = check_prompts(prompts, model.cfg, max_new_tokens)
        try:
            check_stopping(stopping, model.cfg.vocab_size, decode)
        except ValueError as err:
            raise ValueError(f"{OP}: {err}") from None
    except ValueError as err:
        error = err
    _agree(model, ids, how, max_new_tokens, stopping, bool(logprobs), error)
    rows_ids = [p for p in ids for _ in range(how.n)]  # output i * n + j: prompt i's sample j
    device = model.embed.weight.device
    if cost is None:
        from flashpar.infer.planning import forward_cost

        cost = forward_cost(model.cfg, model.options.dtype_bytes, device.type, model.tp)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    first = first_token(model, rows_ids, how, max_new_tokens, strategy, cost, logprobs=logprobs)
    sync()
    ttft = time.perf_counter() - t0
    plan, cache, rows, u, out, logits = first.plan, first.cache, first.rows, first.u, first.out, first.logits
    lens = [len(p) for p in rows_ids]
    positions = torch.tensor([lens[p] for p in cache.rows], dtype=torch.long, device=device)
    enders = torch.tensor(stopping.enders, dtype=torch.long, device=device)
    done = torch.isin(out[:, 0], enders)
    steps = max_new_tokens - 1
    bar = _progress(steps) if progress and steps else None
    t1, ran = time.perf_counter(), 0
    for s in range(steps):
        step_logits = decode_step(model, cache, out[:, s], positions + s, s)
        lp = first.logprobs[:, s + 1] if first.logprobs is not None else None
        out[:, s + 1] = choose(step_logits, u[s + 1], how, first.history, lp)
        if first.history is not None:
            first.history.add(out[:, s + 1])
        ran = s + 1
        if bar is not None:
            bar.update(1)
        if stopping:
            done |= torch.isin(out[:, s + 1], enders)
            if ran % STOP_EVERY == 0:
                if stopping.stop:
                    done = _stop_strings(out[:, :ran + 1], done, stopping, decode)
                if _all_ended(model, done):
                    break
    sync()
    decode_s = time.perf_counter() - t1
    if bar is not None:
        bar.close()
    full = _gather(model, plan, rows, out, len(rows_ids), -1)[:, : ran + 1]
    chosen_lp = (_gather(model, plan, rows, first.logprobs, len(rows_ids), -torch.inf)[:, : ran + 1].tolist()
                 if first.logprobs is not None else None)
    result, reasons, texts, lps = [], [], [], []
    for i, row in enumerate(full.tolist()):
        tokens, reason, text = finish(row, stopping, decode)
        result.append(tokens)
        reasons.append(reason)
        texts.append(text)
        if chosen_lp is not None:
            lps.append(chosen_lp[i][: len(tokens)])
    held = cache.tokens()
    return Generation(result, [len(p) for p in ids], ttft, decode_s, ran, held * cache.bytes_per_token(), held, plan,
                      logits if keep_logits else None, reasons, texts if decode is not None else None,
                      lps if chosen_lp is not None else None, how.n)


def _gather(model, plan: cp.CPPlan, rows: torch.Tensor, values: torch.Tensor, outputs: int, fill) -> torch.Tensor:
    """Every output's row of ``values [rows here, ...]`` on every rank (host): the cp ranks' rows, each written
    by the ranks that decode it (the same values), reduced by their maximum over cp."""
    full = torch.full((outputs, *values.shape[1:]), fill, dtype=values.dtype, device=values.device)
    full.index_copy_(0, rows, values)
    return all_reduce(full, model.cp_group, plan.cp_size, op=torch.distributed.ReduceOp.MAX).cpu()


def _stop_strings(out: torch.Tensor, done: torch.Tensor, stopping: Stopping, decode) -> torch.Tensor:
    """``done`` with the rows whose text (up to their first end token) holds a stop string marked (the tokens
    read on the host)."""
    ended = done.tolist()
    enders = set(stopping.enders)
    for r, row in enumerate(out.cpu().tolist()):
        if not ended[r]:
            end = next((i for i, t in enumerate(row) if t in enders), len(row) - 1)
            ended[r] = stop_string_end(row[: end + 1], stopping.stop, decode) is not None
    return torch.tensor(ended, dtype=torch.bool, device=done.device)


@dataclass
class Started:
    """What the time to first token makes: the ``plan``, this rank's ``cache``, its ``rows`` (``cache.rows`` on
    the device), their uniform numbers ``u [max_new_tokens, rows]``, the chosen tokens ``out [rows,
    max_new_tokens]`` (column 0 filled: the first token), the prefill's ``logits [prompts, V]``, the rows'
    penalty ``history`` (None without penalties) and the chosen tokens' ``logprobs [rows, max_new_tokens]``
    (column 0 filled; None unless asked for)."""

    plan: cp.CPPlan
    cache: RankCache
    rows: torch.Tensor
    u: torch.Tensor
    out: torch.Tensor
    logits: torch.Tensor
    history: History | None = None
    logprobs: torch.Tensor | None = None


def first_token(model, ids: list[list[int]], how: Sampling, max_new_tokens: int, strategy: str, cost, *,
                logprobs: bool = False) -> Started:
    """The time to first token of checked prompts ``ids`` (one per output): planning, the cache's set-up, the
    prefill and the first choice (every rank of the mesh calls it with the same arguments)."""
    plan = cp.plan([len(p) for p in ids], model.mesh["cp"].size(), strategy=strategy, cost=cost)
    cache, rows, u, out, tokens_cp = set_up(model, ids, plan, how, max_new_tokens)
    logits = prefill(model, tokens_cp, plan, cache)
    history = None
    if how.penalized:
        history = History([ids[p] for p in cache.rows], model.cfg.vocab_size, out.device,
                          repetition=how.repetition_penalty != 1,
                          counted=how.presence_penalty != 0 or how.frequency_penalty != 0)
    lp = torch.zeros(out.shape, dtype=torch.float64, device=out.device) if logprobs else None
    out[:, 0] = choose(logits.index_select(0, rows), u[0], how, history, lp[:, 0] if lp is not None else None)
    if history is not None:
        history.add(out[:, 0])
    return Started(plan, cache, rows, u, out, logits, history, lp)


def set_up(model, ids: list[list[int]], plan: cp.CPPlan, how: Sampling, max_new_tokens: int):
    """``(cache, rows, u, out, tokens_cp)`` of ``Started`` for ``plan``, and this cp rank's prompt tokens."""
    device, cfg = model.embed.weight.device, model.cfg
    schedule = cache_schedule(plan, max_new_tokens - 1)
    cache = RankCache(plan, schedule, model.cp_rank, cfg.layers, model.blocks[0].kv_heads, cfg.head_dim,
                      model.compute_dtype, device)
    rows = torch.tensor(cache.rows, dtype=torch.long, device=device)
    u = uniforms(how.generator_seed, max_new_tokens, len(ids)).to(device)[:, rows]  # [steps, rows]
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

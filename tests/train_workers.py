"""Per-rank bodies of the parallel-model tests (run by dist_harness.run_ranks)."""

from __future__ import annotations

import dataclasses
import os
import random
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from flashpar.models import LlamaConfig
from flashpar.models.parallel import MESH_DIMS
from flashpar.train.check import TOL, one_step

CFG = LlamaConfig(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64)
MODELS = {  # the model of a case, by name (cases stay short, picklable tuples)
    "base": CFG,
    "untied": dataclasses.replace(CFG, tie_embeddings=False),
    "heads6": dataclasses.replace(CFG, hidden=48, heads=6, kv_heads=3),  # ulysses 3: 2 q heads, 1 kv head per rank
    "heads6-mqa": dataclasses.replace(CFG, hidden=48, heads=6, kv_heads=1),  # ulysses 3: the kv head on every rank
    # vocabularies smaller than a cp rank's tokens: the tp ranks gather the embedding / head weight
    # (flashpar.models.vocab.gathers_weight); with per_doc at cp 2 the cp ranks hold 56 and 51 tokens, so their
    # tp groups take different paths at vocabulary 54 (test_parallel_model checks it)
    "vocab16": dataclasses.replace(CFG, vocab_size=16),
    "vocab16-untied": dataclasses.replace(CFG, kv_heads=4, vocab_size=16, tie_embeddings=False),  # tp 4: 4 kv heads
    "vocab54": dataclasses.replace(CFG, vocab_size=54),
    "heads6-vocab12": dataclasses.replace(CFG, hidden=48, heads=6, kv_heads=3, ffn=72, vocab_size=12),
}


def sequences(dp: int, seed: int = 0, vocab: int = 256):
    """``dp`` packed sequences: (tokens, labels, doc_lens); labels are the next token of the same document."""
    rng = random.Random(seed)
    out = []
    for _ in range(dp):
        doc_lens = [rng.choice([1, 3, 8, 17, 30]) for _ in range(7)]
        total = sum(doc_lens)
        tokens = torch.tensor([rng.randrange(vocab) for _ in range(total)])
        labels = torch.roll(tokens, -1)
        ends = torch.tensor(doc_lens).cumsum(0) - 1
        labels[ends] = -100
        out.append((tokens, labels, doc_lens))
    return out


def check_mesh(rank, world, shape, dp_mode="zero3", model="base", strategy="flashcp", mode="flash",
               regather=False, zero_schedule="prefetch", prefetch=1, zero_collective="ring", attention_backend="auto"):
    """``one_step``'s errors over ``TOL`` and their count on the (dp, cp, ulysses, tp) mesh ``shape``
    (``regather``, ``zero_schedule`` / ``prefetch`` / ``zero_collective``, ``attention_backend``: the
    ``ParallelOptions``')."""
    dp = shape[0]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIMS)
    errors = one_step(MODELS[model], mesh, sequences(dp, vocab=MODELS[model].vocab_size), strategy=strategy,
                      mode=mode, dp_mode=dp_mode, regather=regather, zero_schedule=zero_schedule,
                      prefetch=prefetch, zero_collective=zero_collective, attention_backend=attention_backend)
    return {k: v for k, v in errors.items() if not v <= TOL}, len(errors)


def check_meshes(rank, world, cases):
    """``check_mesh`` for each ``(shape, dp_mode, model)`` of ``cases``, in one spawn (start-up is most of a case)."""
    return [check_mesh(rank, world, *case) for case in cases]


def optim_meshes(rank, world, cases):
    """For each ``(shape, dp_mode, model, micro_batches, clip_ratio)`` of ``cases``: ``one_step`` with that many
    micro-batches per dp rank and the gradients clipped to ``clip_ratio`` x their norm, as ``(errors over
    TOL, number of errors, the norm's error, the worst error)``."""
    from flashpar.train.check import NORM

    out = []
    for shape, dp_mode, model, micro, ratio in cases:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIMS)
        seqs = sequences(micro * shape[0], seed=micro)
        errors = one_step(MODELS[model], mesh, seqs, strategy="flashcp", mode="flash", dp_mode=dp_mode,
                          micro_batches=micro, clip_ratio=ratio)
        out.append(({k: v for k, v in errors.items() if not v <= TOL}, len(errors), errors[NORM],
                    max(errors.values())))
    return out


def decay_step(rank, world, shape):
    """``build``'s AdamW on mesh ``shape`` after one step on zero gradients at the rate 0.5 (``set_lr``): per mesh
    parameter, ``(decayed, max |p_after - p_before (1 - 0.5 wd)|, max |p_after - p_before|)``."""
    from flashpar.train.config import TrainConfig
    from flashpar.train.optimizer import decays, set_lr
    from flashpar.train.step import build

    dp, cpn, ulysses, tp = shape
    config = TrainConfig(nproc=world, dp=dp, cp=cpn, ulysses=ulysses, tp=tp, model=CFG, timeout=60.0)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIMS)
    _, model, opt = build(config, mesh, torch.device("cpu"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    set_lr(opt, 0.5)
    opt.step()
    shrunk = 1 - 0.5 * config.weight_decay
    after = {n: p.detach() for n, p in model.named_parameters()}
    return {n: (decays(n), float((p - before[n] * shrunk).abs().max()), float((p - before[n]).abs().max()))
            for n, p in after.items()}


# ---- fault-injection hooks (flashpar.train.loop.Hooks.before_step), pickled into the spawned ranks -----------


def exit_at(step: int, *, rank: int, at: int, code: int = 17) -> None:
    """Rank ``rank`` dies without a Python exception before step ``at`` (a killed or crashed process)."""
    if dist.get_rank() == rank and step == at:
        os._exit(code)


def raise_at(step: int, *, rank: int, at: int) -> None:
    """Rank ``rank`` raises before step ``at``."""
    if dist.get_rank() == rank and step == at:
        raise RuntimeError(f"injected fault at step {step}")


# ---- every CP strategy x TP mode x dp mode through train_step, in one spawn ----------------------------------


def train_combinations(rank, world, cases):
    """``{(shape, strategy, mode, dp_mode): (float64 reference loss, [loss of step 1, step 2], FutureWarnings)}``
    for every case: a fresh model (``build``: the same seeded weights) trained two steps with ``train_step`` on
    the same batch, the loss summed over the ranks."""
    from flashpar import cp
    from flashpar.models import Llama, next_token_loss
    from flashpar.train.config import TrainConfig
    from flashpar.train.step import build, train_step

    meshes, out = {}, {}
    for shape, strategy, mode, dp_mode in cases:
        if shape not in meshes:
            meshes[shape] = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIMS)
        mesh, (dp, cpn, ulysses, tp) = meshes[shape], shape
        config = TrainConfig(nproc=world, dp=dp, cp=cpn, ulysses=ulysses, tp=tp, strategy=strategy, mode=mode,
                             dp_mode=dp_mode, model=CFG, timeout=60.0)
        batch = sequences(dp)
        count = sum(int((lab != -100).sum()) for _, lab, _ in batch)
        torch.manual_seed(config.seed)  # build's weights, in float64
        ref = Llama(CFG).double()
        with torch.no_grad():
            ref_loss = float(sum(next_token_loss(ref(tok, lens), lab, count) for tok, lab, lens in batch))
        tokens, labels, doc_lens = batch[mesh["dp"].get_local_rank()]
        c = mesh["cp"].get_local_rank()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, model, opt = build(config, mesh, torch.device("cpu"))
            losses = []
            for _ in range(2):
                plan = cp.plan(doc_lens, cpn, strategy=strategy)
                loss = train_step(model, opt, cp.shard(tokens, plan, c), cp.shard(labels, plan, c), plan, count)
                dist.all_reduce(loss)
                losses.append(float(loss))
        future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
        out[(shape, strategy, mode, dp_mode)] = (ref_loss, losses, future)
    return out


# ---- the vocabulary-parallel loss against float64 cross-entropy, tp groups of 1 to 4 ranks in one spawn ------


def vocab_loss_cases(rank, world):
    """``[(tp, loss relative error, gradient relative error, FutureWarnings)]`` of ``vocab_parallel_loss``
    on the tp group ``range(tp)`` (this rank's vocabulary columns and rows) against ``F.cross_entropy`` of
    the full float64 logits."""
    import torch.nn.functional as F

    from flashpar.models.vocab import vocab_parallel_loss
    from flashpar.rows import shard_rows

    out = []
    for tp in range(1, world + 1):
        group = dist.new_group(list(range(tp)))  # every rank creates every group
        if rank >= tp:
            continue
        torch.manual_seed(tp)
        full = (3 * torch.randn(10, 12, dtype=torch.float64)).requires_grad_()
        labels = torch.randint(0, 12, (10,))
        labels[[2, 7]] = -100
        count = float((labels != -100).sum())
        ref = F.cross_entropy(full, labels, ignore_index=-100, reduction="sum") / count
        ref.backward()
        lo, hi = shard_rows(12, tp, rank)
        r0, r1 = shard_rows(10, tp, rank)
        mine = full.detach()[:, lo:hi].clone().requires_grad_()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = vocab_parallel_loss(mine, labels, lo, group, slice(r0, r1), count)
            loss.backward()
        total = loss.detach().double()
        dist.all_reduce(total, group=group)
        want = full.grad[:, lo:hi]
        out.append((tp, float(abs(total - ref) / ref), float((mine.grad - want).abs().max() / want.abs().max()),
                    [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]))
    return out


def gathered_vocab_cases(rank, world):
    """``[(tp, loss relative error, embedding-gradient relative error, projection-gradient relative error)]`` of
    the gathered-weight path (``flashpar.models.zero.all_gather_rows``, ``own_rows_loss``) on the tp group
    ``range(tp)``, tied: this rank's vocabulary rows ``E[lo:hi]`` gathered once, looked up for its rows of
    tokens, projected, and used as the head of those rows; against the same computation on the full float64
    tensors in one process."""
    import torch.nn.functional as F

    from flashpar.models.vocab import own_rows_loss
    from flashpar.models.zero import all_gather_rows
    from flashpar.rows import shard_rows

    def loss_of(e_full, a, tok, lab, count):
        return own_rows_loss(F.embedding(tok, e_full) @ a, e_full, lab, count)

    out = []
    for tp in range(1, world + 1):
        group = dist.new_group(list(range(tp)))  # every rank creates every group
        if rank >= tp:
            continue
        torch.manual_seed(100 + tp)
        e_full = torch.randn(12, 5, dtype=torch.float64).requires_grad_()
        a = torch.randn(5, 5, dtype=torch.float64)
        tokens = torch.randint(0, 12, (10,))
        labels = torch.randint(0, 12, (10,))
        labels[[2, 7]] = -100
        count = float((labels != -100).sum())
        ref = loss_of(e_full, a, tokens, labels, count)
        ref.backward()
        lo, hi = shard_rows(12, tp, rank)
        r0, r1 = shard_rows(10, tp, rank)
        e_mine = e_full.detach()[lo:hi].clone().requires_grad_()
        gathered = all_gather_rows(e_mine, group, 12)
        a_mine = a.clone().requires_grad_()
        loss = loss_of(gathered, a_mine, tokens[r0:r1], labels[r0:r1], count)
        loss.backward()
        total = loss.detach().double()
        dist.all_reduce(total, group=group)
        grad_a = a_mine.grad.clone()
        dist.all_reduce(grad_a, group=group)
        a_ref = a.clone().requires_grad_()
        loss_of(e_full.detach(), a_ref, tokens, labels, count).backward()
        want = e_full.grad[lo:hi]
        out.append((tp, float(abs(total - ref) / ref), float((e_mine.grad - want).abs().max() / want.abs().max()),
                    float((grad_a - a_ref.grad).abs().max() / a_ref.grad.abs().max())))
    return out


# ---- a checkpoint of a Ulysses mesh loaded on other meshes (DCP, one spawn) ------------------------------------


def checkpoint_across_meshes(rank, world, saved, loaded):
    """One ``train_step`` on mesh ``saved``, ``checkpoint.save``; then for each mesh of ``loaded``: a fresh model
    (another seed), ``checkpoint.load``, and ``(shape, max |difference| of the full weights and AdamW moments
    against the saved model's, loss of the saved model, loss of the loaded one)``; the losses are of one
    sequence that every dp rank reads (so every mesh computes the same mean)."""
    import shutil
    import tempfile
    from pathlib import Path

    from flashpar import cp
    from flashpar.train import checkpoint
    from flashpar.train.config import TrainConfig
    from flashpar.train.step import build, forward_backward, train_step

    tokens, labels, doc_lens = sequences(1, seed=1)[0]
    targets = int((labels != -100).sum())

    def on(shape, seed):
        dp, cpn, ulysses, tp = shape
        config = TrainConfig(nproc=world, dp=dp, cp=cpn, ulysses=ulysses, tp=tp, model=CFG, timeout=60.0, seed=seed)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIMS)
        _, model, opt = build(config, mesh, torch.device("cpu"))
        return config, mesh, model, opt

    def shards(mesh):  # this rank's tokens and targets of the sequence, its plan, the global targets
        plan, c = cp.plan(doc_lens, mesh["cp"].size()), mesh["cp"].get_local_rank()
        return cp.shard(tokens, plan, c), plan, cp.shard(labels, plan, c), targets * mesh["dp"].size()

    def loss_of(mesh, model):  # the loss summed over the ranks, no update
        tok, plan, lab, count = shards(mesh)
        loss = forward_backward(model, tok, lab, plan, count)
        model.zero_grad(set_to_none=True)
        dist.all_reduce(loss)
        return float(loss)

    folder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folder)
    path = Path(folder[0]) / "step_1"
    try:
        config, mesh, model, opt = on(saved, 0)
        tok, plan, lab, count = shards(mesh)
        train_step(model, opt, tok, lab, plan, count)
        checkpoint.save(path, model, opt, 1, config)
        want = checkpoint._full_state(model, opt)
        out = []
        for shape in loaded:
            _, mesh2, model2, opt2 = on(shape, 1)
            checkpoint.load(path, model2, opt2)
            got = checkpoint._full_state(model2, opt2)
            differ = max(float((got[k][n] - t).abs().max()) for k in want if k != "optim" for n, t in want[k].items())
            out.append((shape, differ, loss_of(mesh, model), loss_of(mesh2, model2)))
        return out
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder[0], ignore_errors=True)


def stop_at(step: int, *, rank: int, at: int) -> None:
    """``Hooks.before_step``: ``rank`` stops itself (SIGSTOP: alive, not dead, never answering) at step ``at``."""
    import signal

    if step == at and dist.get_rank() == rank:
        os.kill(os.getpid(), signal.SIGSTOP)


def kill_during(step: int, *, rank: int, at: int, after_s: float) -> None:
    """``Hooks.before_step``: ``rank`` is SIGKILLed ``after_s`` seconds into step ``at`` (in the middle of its
    work: a timer thread sends the signal while the step runs)."""
    import signal
    import threading

    if step == at and dist.get_rank() == rank:
        threading.Timer(after_s, os.kill, (os.getpid(), signal.SIGKILL)).start()

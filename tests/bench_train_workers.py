"""Rank functions for ``tests/test_bench_train.py`` (importable by the spawned ranks)."""

from __future__ import annotations

import datetime
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flashpar.models import Llama, LlamaConfig
from flashpar.models.llama import IGNORE

# tp up to 4 and 3 divide the heads, kv heads, ffn and vocabulary; untied (the torch peer's TP needs it)
CFG = LlamaConfig(hidden=48, layers=2, heads=12, kv_heads=12, ffn=96, tie_embeddings=False)
DOCS = [12, 24, 12, 24]  # multiples of 2 cp for cp in 1..3 (torch's per-document head-tail chunks)


def _sequences(dp: int):
    """dp packed sequences of the documents ``DOCS``: seeded tokens, next-token labels inside each document."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(dp):
        tokens = torch.randint(0, CFG.vocab_size, (sum(DOCS),), generator=gen)
        labels = torch.roll(tokens, -1)
        labels[torch.tensor(DOCS).cumsum(0) - 1] = IGNORE
        out.append((tokens, labels))
    return out


def peer_against_llama(rank: int, n: int, meshes) -> dict:
    """For every ``(dp, cp, tp, attention)`` of ``meshes`` (``dp cp tp = n``; attention ``docs`` or ``dense``): the
    torch peer's loss (summed over the ranks) and the largest relative error of every parameter's gradient
    against the single-process ``Llama`` on the same weights and sequences, in float64."""
    from torch.distributed.tensor import DTensor

    from flashpar.bench import torch_parallel
    from flashpar.bench.torch_llama import full_name

    warnings.filterwarnings("ignore")
    out = {}
    for dp, cp, tp, attention in meshes:
        torch.manual_seed(0)
        full = Llama(CFG).double()
        seqs = _sequences(dp)
        count = float(sum(int((lab != IGNORE).sum()) for _, lab in seqs))
        ref = sum(F.cross_entropy(full(tok, DOCS), lab, ignore_index=IGNORE, reduction="sum") for tok, lab in seqs)
        (ref / count).backward()
        mesh = torch_parallel.make_mesh(dp, cp, tp, "cpu")
        model, _ = torch_parallel.build(CFG, mesh, full, "cpu", lr=1e-3)
        model.double()
        tokens, labels = seqs[mesh["dp"].get_local_rank()]
        batch = torch_parallel.make_batch(tokens, labels, DOCS, mesh, "cpu", attention)
        share = torch_parallel.forward_backward(model, batch, count, tp)
        total = share.clone()
        dist.all_reduce(total)
        grads = dict(full.named_parameters())
        errors = {}
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            r = grads[full_name(name, CFG)].grad
            errors[name] = float((g - r).abs().max() / r.abs().max())
        out[(dp, cp, tp, attention)] = {"loss": float(total), "ref": float(ref / count),
                                        "grad_err": max(errors.values()), "worst": max(errors, key=errors.get)}
    return out


def solo_without_comm(rank: int, n: int, config: dict) -> dict:
    """Every configuration built and stepped once on every rank; then rank 0 alone runs a step of each inside
    ``no_comm()`` while the others wait on the store.  Any transfer that escaped the fakes would wait for a peer
    that never comes (the group's timeout, 60 s): rank 0 reports the names it finished."""
    from flashpar.bench import train as bench_train
    from flashpar.bench.no_comm import communicating, no_comm

    warnings.filterwarnings("ignore")
    config = {**config, "rank_timeout": 60.0}
    seqs = bench_train.sequences(config)
    meshes = bench_train.make_meshes(config)
    runners = {name: bench_train.Runner(name, config, seqs, meshes) for name in config["configs"]}
    for runner in runners.values():
        runner.step()
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    done = []
    if rank == 0:
        for name, runner in runners.items():
            with no_comm():
                assert not communicating()
                runner.step()
            done.append(name)
        store.set("solo-done", "1")
    else:
        store.wait(["solo-done"], datetime.timedelta(seconds=120))
    dist.barrier()
    return {"done": done, "restored": communicating()}


def compiled_against_eager(rank: int, n: int) -> dict:
    """At tp ``n`` (dp 1, cp 1): the eager torch peer and the compiled one (``compile_blocks``), each two AdamW steps
    on the same fp32 weights and sequence of ``DOCS``.  Their summed losses per step, the largest relative error of
    a first-step gradient (against the largest of that parameter's), the seconds torch.compile spent
    (``flashpar.bench.compile_time``) and the compilations in the first step and after it."""
    from torch.distributed.tensor import DTensor

    from flashpar.bench import torch_parallel
    from flashpar.bench.compile_time import compile_seconds, compiles

    warnings.filterwarnings("ignore")
    cfg = LlamaConfig(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, tie_embeddings=False)
    tokens = torch.randint(0, cfg.vocab_size, (sum(DOCS),), generator=torch.Generator().manual_seed(7))
    labels = torch.roll(tokens, -1)
    labels[torch.tensor(DOCS).cumsum(0) - 1] = IGNORE
    count = float((labels != IGNORE).sum())
    mesh = torch_parallel.make_mesh(1, 1, n, "cpu")
    out = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        torch.manual_seed(0)
        model, opt = torch_parallel.build(cfg, mesh, Llama(cfg), "cpu", lr=1e-3, compile_blocks=compiled)
        batch = torch_parallel.make_batch(tokens, labels, DOCS, mesh, "cpu")
        losses = []
        for step in range(2):
            s0, k0 = compile_seconds(), compiles()
            loss = torch_parallel.forward_backward(model, batch, count, n)
            if step == 0:
                full = {k: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
                        for k, p in model.named_parameters()}
                out[name + "_grads"] = {k.replace("_orig_mod.", ""): g for k, g in full.items()}  # compiled blocks
                if compiled:
                    out.update(compile_s=compile_seconds() - s0, compiles_first_step=compiles() - k0)
            elif compiled:
                out["compiles_later"] = compiles() - k0
            opt.step()
            opt.zero_grad(set_to_none=True)
            dist.all_reduce(loss)
            losses.append(float(loss))
        out[name] = losses
    eager, comp = out.pop("eager_grads"), out.pop("compiled_grads")
    assert set(eager) == set(comp), (sorted(eager), sorted(comp))
    out["grad_err"] = max(float((comp[k] - g).abs().max() / g.abs().max()) for k, g in eager.items())
    return out

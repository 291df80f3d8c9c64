"""Processes and hooks of the failure drills (``tests/test_faults.py``).

``saver``: one process, one rank (gloo on a ``HashStore``: no network), a tiny model trained on
synthetic sequences, ``checkpoint.save`` after every step; on start it resumes from the newest
checkpoint that passes (``checkpoint.latest``).  It tells the test what happens through a pipe, so the
test can kill it at a random moment of a save, or change the file system between two saves.

``poison`` and ``listeners_on_loopback`` are ``Hooks`` of ``flashpar train`` runs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from flashpar.models import LlamaConfig

CFG = LlamaConfig(vocab_size=256, hidden=32, layers=1, heads=2, kv_heads=1, ffn=64)
SEQ = 64


def batch(step: int):
    """Step ``step``'s sequence (the same in every process): two documents of random tokens."""
    from flashpar import cp
    from flashpar.train.step import MicroBatch

    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, CFG.vocab_size, (SEQ,), generator=g)
    labels = torch.randint(0, CFG.vocab_size, (SEQ,), generator=g)
    return MicroBatch(tokens, labels, cp.plan([SEQ // 2 - 3, SEQ // 2 + 3], 1))


def saver(folder: str, steps: int, conn, wait_after: tuple[int, ...] = ()) -> None:
    """Train steps 1..``steps`` (from the newest good checkpoint in ``folder``), saving after each; send
    ``("resumed", step, cpu s)``, ``("skipped", line)``, ``("loss", step, loss)``, ``("saving", step)``,
    ``("saved", step, seconds)``, ``("stopped", line)`` (a ``JobStop`` of a save: the process goes on to the
    next step) and ``("done", cpu s)``.  After the saves of ``wait_after`` it waits for the test's go (a
    message on ``conn``)."""
    from torch.distributed.device_mesh import init_device_mesh

    from flashpar.models.parallel import MESH_DIMS
    from flashpar.train import checkpoint
    from flashpar.train.config import TrainConfig
    from flashpar.train.step import build, optimizer_step
    from flashpar.train.stop import JobStop

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=MESH_DIMS)
    config = TrainConfig(nproc=1, dp=1, cp=1, tp=1, model=CFG, seq_len=SEQ, max_docs=40, timeout=60.0)
    _, model, opt = build(config, mesh, torch.device("cpu"))
    folder, start = Path(folder), 0
    try:
        path = checkpoint.latest(folder, say=lambda line: conn.send(("skipped", line)))
        checkpoint.load(path, model, opt)
        start = checkpoint.read_meta(path, config)["step"]
    except FileNotFoundError:
        pass
    conn.send(("resumed", start, time.process_time()))
    for step in range(start + 1, steps + 1):
        loss, _ = optimizer_step(model, opt, [batch(step)], float(SEQ), clip=1.0, lr=1e-2)
        conn.send(("loss", step, float(loss)))
        conn.send(("saving", step))
        t0 = time.perf_counter()
        try:
            checkpoint.save(folder / f"step_{step}", model, opt, step, config, keep=2)
            conn.send(("saved", step, time.perf_counter() - t0))
        except JobStop as err:
            conn.send(("stopped", str(err)))
        if step in wait_after:
            conn.recv()
    conn.send(("done", time.process_time()))
    dist.destroy_process_group()


# ---- hooks of flashpar train runs (pickled into the ranks: module-level functions) ------------------------------


def poison(step: int, model, *, rank: int, at: tuple[int, ...]) -> None:
    """Rank ``rank``'s loss at the steps of ``at`` is NaN (its forward's output times NaN: a batch that makes
    the model produce NaN, e.g. an overflow), so its gradients are NaN too; the other ranks' are finite."""
    if dist.get_rank() != rank or step not in at:
        return

    def nan_once(module, args, out):
        handle.remove()
        return out * float("nan")

    handle = model.register_forward_hook(nan_once)


def _listening(path: str) -> list[tuple[str, int, int]]:
    """(address hex, port, inode) of the sockets listening in ``/proc/net/tcp`` or ``tcp6``."""
    out = []
    for line in Path(path).read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A":  # TCP_LISTEN
            addr, port = fields[1].rsplit(":", 1)
            out.append((addr, int(port, 16), int(fields[9])))
    return out


LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::1


def listeners_on_loopback(step: int) -> None:
    """At step 1, on every rank: raise unless the rendezvous (``MASTER_PORT``) and every socket this rank listens
    on are bound to a loopback address (the kernel's tables: an unbound ``0.0.0.0`` / ``::`` is not)."""
    if step != 1:
        return
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(int(target[8:-1]))
    port = int(os.environ["MASTER_PORT"])
    rows = _listening("/proc/net/tcp") + _listening("/proc/net/tcp6")
    store = [addr for addr, p, _ in rows if p == port]
    own = [(addr, p) for addr, p, inode in rows if inode in mine]
    wrong = [a for a in store if a not in LOOPBACK] + [f"{a}:{p}" for a, p in own if a not in LOOPBACK]
    if not store or wrong:
        raise RuntimeError(f"rank {dist.get_rank()}: listening beyond loopback: store {store}, own {own}")

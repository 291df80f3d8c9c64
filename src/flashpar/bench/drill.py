"""``flashpar bench drill``: a multi-node failure drill on one machine.  Network namespaces stand for nodes, torchrun
runs on each with c10d rendezvous and ``--max-restarts``, and ranks of the last node fail mid-run: the job must
restart by itself, resume from its newest checkpoint and end with the losses of a run that never failed::

      ns node0 (10.213.9.1)                          ns node1 (10.213.9.2)
      torchrun agent (c10d host)                     torchrun agent
        rank 0   rank 1                                rank 2   rank 3      <- fault: SIGKILL at step a, then
          │ tp │                                         │ tp │                  SIGSTOP at step b (the peers'
          └────┴──────────── cp (veth + bridge) ─────────┴────┘                  watchdog finds it)
                                 shared --out: checkpoints/, metrics.jsonl, .where/

Each node's agent runs ``flashpar train ... --resume auto --save-every S --watchdog W``: the same command line for the
first launch and every restart.  A fault thread reads the ranks' phase stamps (``<out>/.where``: pid and step) and
sends the fault to the victim's process when it begins step ``a`` (``b``).  Then the drill measures:

* restart time: from the fault to the first step the restarted job finishes (rank 0's next ``metrics.jsonl`` row);
* steps lost: the fault's step minus the checkpoint the job resumed from (at most ``--save-every``);
* the losses: every step's last row against a run without faults (``--reference``: the same flags and ranks per
  node, flashpar's own launcher), equal to the last bit: the same arithmetic in the same order;
* nothing left: both agents' exit status (0), no process in either namespace when they have exited, the namespaces
  removed at the end (``flashpar.bench.netlink.EmulatedLinks``).

Needs root (network namespaces).  Runs in a minute or two at the default sizes (a tiny model).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from flashpar.bench.netlink import EmulatedLinks, links_available
from flashpar.lifeline import die_with_parent
from flashpar.train import where
from flashpar.train.config import TrainConfig

FAULTS = ("kill", "stop")
SUBNET = "10.213.9"  # apart from the benchmarks' links (10.213.7), so that both can run at once
SEQ_LEN = 128
TRAIN_FLAGS = ["--seq-len", str(SEQ_LEN), "--max-docs", "40", "--workers", "0"]
"""The data of the drill's runs (the default tiny Llama on the standard library's sources: steps of a fraction of a
second, so the drill's time goes to start-up, faults and restarts).  The mesh is cp = nodes x tp = ranks per node:
tp inside a node, cp across (``train_argv``)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=2, help="namespaces standing for nodes: the mesh's cp (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=2,
                   help="torchrun workers per node: the mesh's tp, inside a node (default 2)")
    p.add_argument("--steps", type=int, default=12, help="steps of the run (default 12)")
    p.add_argument("--save-every", type=int, default=3, help="checkpoint every K steps (default 3)")
    p.add_argument("--faults", default="kill,stop",
                   help="the faults in order, each on a rank of the last node at a later step: kill (SIGKILL), stop "
                        "(SIGSTOP: found by the peers' --watchdog) (default kill,stop)")
    p.add_argument("--watchdog", type=float, default=8.0, help="the runs' --watchdog seconds (default 8)")
    p.add_argument("--max-restarts", type=int, default=None, help="torchrun's --max-restarts (default: the faults)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault steps and victims (default 0)")
    p.add_argument("--reference", action="store_true", help="also run without faults and compare the losses")
    p.add_argument("--out", default="runs/drill", help="folder of the runs (default runs/drill)")
    p.add_argument("--timeout", type=float, default=600.0, help="the most the drill may take, seconds (default 600)")
    p.add_argument("--json", default=None, help="write the report here as JSON")


@dataclass
class Fault:
    kind: str
    rank: int
    step: int
    pid: int = 0
    at: float = 0.0  # time.time() it was sent
    resumed_from: int | None = None  # the checkpoint step the next attempt resumed from
    restart_s: float | None = None  # fault -> the first step finished after it


@dataclass
class Drill:
    nodes: int
    per_node: int
    steps: int
    save_every: int
    faults: list[Fault]
    watchdog: float
    max_restarts: int
    out: Path
    agents: list[int] = field(default_factory=list)  # exit statuses
    leftover: list[str] = field(default_factory=list)  # processes still in a namespace after the agents exited

    @property
    def world(self) -> int:
        return self.nodes * self.per_node


def plan(nodes: int, per_node: int, steps: int, save_every: int, kinds: list[str], seed: int) -> list[Fault]:
    """The faults: each on a random rank of the last node, at a random step of its own window of the steps after
    the first checkpoint (so in order, and at least one step after the last)::

        steps 1 .. S (first checkpoint) | window of fault 1 | window of fault 2 | ... | the last step
    """
    rng = random.Random(seed)
    room = steps - 1 - save_every
    if room < len(kinds):
        raise ValueError(f"--steps {steps} leaves no room for {len(kinds)} faults after the first checkpoint "
                         f"(step {save_every}): raise --steps")
    span = room // len(kinds)
    return [Fault(kind, rng.randrange((nodes - 1) * per_node, nodes * per_node),
                  rng.randint(save_every + 1 + i * span, save_every + (i + 1) * span)) for i, kind in enumerate(kinds)]


def train_argv(d: Drill, out: Path) -> list[str]:
    return ["--cp", str(d.nodes), "--tp", str(d.per_node), *TRAIN_FLAGS, "--steps", str(d.steps), "--save-every",
            str(d.save_every), "--watchdog", f"{d.watchdog:g}", "--timeout", "120", "--out", str(out)]


def _agent(links: EmulatedLinks, node: int, d: Drill, port: int, log) -> subprocess.Popen:
    """Node ``node``'s torchrun agent, in its namespace, dying with this process."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(d.nodes), "--nproc-per-node",
            str(d.per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{links.addresses[0]}:{port}",
            "--rdzv-id", f"drill{os.getpid()}", "--rdzv-conf", f"is_host={int(node == 0)}",  # torch finds the host
            # by the machine's names and addresses, which a namespace does not change
            "--local-addr", links.addresses[node], "--max-restarts",
            str(d.max_restarts), "--monitor-interval", "0.5", "-m", "flashpar.cli", "train",
            *train_argv(d, d.out), "--resume", "auto"]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": links.ifname, "OMP_NUM_THREADS": "1"}
    me = os.getpid()
    return subprocess.Popen(links.wrap(node, argv), env=env, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: die_with_parent(me))  # noqa: PLW1509 - prctl only


def _rows(metrics: Path) -> list[dict]:
    if not metrics.is_file():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def _inject(d: Drill, stop: threading.Event) -> None:
    """The fault thread: each fault when its victim's stamp reaches its step, then its restart time."""
    stamps_dir, metrics = d.out / ".where", d.out / "metrics.jsonl"
    done_pids: set[int] = set()
    for fault in d.faults:
        while not stop.is_set():
            stamps = where.read(stamps_dir) if stamps_dir.is_dir() else {}
            s = stamps.get(fault.rank)
            if s is not None and s[0] not in done_pids and s[1] >= fault.step:
                rows_before = len(_rows(metrics))
                fault.pid, fault.step, fault.at = s[0], s[1], time.time()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(s[0], signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)
                done_pids.add(s[0])
                break
            time.sleep(0.02)
        while not stop.is_set():  # the restarted job's first finished step
            rows = _rows(metrics)
            if len(rows) > rows_before:
                fault.restart_s = time.time() - fault.at
                fault.resumed_from = rows[rows_before]["step"] - 1
                break
            time.sleep(0.05)


def run_drill(d: Drill, timeout: float) -> Drill:
    """Build the namespaces, start the agents, inject the faults, wait for the agents, check what is left."""
    import shutil

    shutil.rmtree(d.out, ignore_errors=True)
    d.out.mkdir(parents=True)
    with EmulatedLinks(d.nodes, "10gbit", subnet=SUBNET) as links:
        logs = [open(d.out / f"agent_node{n}.log", "w") for n in range(d.nodes)]  # noqa: SIM115
        agents = [_agent(links, n, d, 29400, logs[n]) for n in range(d.nodes)]
        stop = threading.Event()
        injector = threading.Thread(target=_inject, args=(d, stop), daemon=True)
        injector.start()
        try:
            deadline = time.monotonic() + timeout
            for a in agents:
                a.wait(timeout=max(1.0, deadline - time.monotonic()))
            d.agents = [a.returncode for a in agents]
            for n in range(d.nodes):
                pids = subprocess.run(["ip", "netns", "pids", links.netns(n)], capture_output=True,
                                      text=True).stdout.split()
                d.leftover += [f"node {n}: pid {p}" for p in pids]
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the drill took more than --timeout {timeout:g} s: see {d.out}/agent_node*.log") \
                from None
        finally:
            stop.set()
            for a in agents:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(a.pid, signal.SIGKILL)
                a.wait()
            for log in logs:
                log.close()
    return d


def reference(d: Drill, out: Path) -> list[dict]:
    """The same run without faults, on flashpar's own launcher (one process per rank on this machine), told the
    drill's ranks per node (``LOCAL_WORLD_SIZE``): the planner and ZeRO-3's choices read each group's link from the
    placement (``flashpar.links``), and on other links they may cut the sequences otherwise, exact in the math but
    not to the last bit."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    argv = [sys.executable, "-m", "flashpar.cli", "train", *train_argv(d, out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": str(d.per_node)}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the reference run failed: {proc.stderr.strip().splitlines()[-1:]}")
    return _rows(out / "metrics.jsonl")


def last_rows(rows: list[dict]) -> dict[int, dict]:
    """Step -> its last row (a step run again after a restart is written again)."""
    return {r["step"]: r for r in rows}


def report(d: Drill, ref: list[dict] | None) -> dict:
    rows = last_rows(_rows(d.out / "metrics.jsonl"))
    out = {"nodes": d.nodes, "ranks_per_node": d.per_node, "steps": d.steps, "save_every": d.save_every,
           "watchdog_s": d.watchdog, "max_restarts": d.max_restarts, "agents_exit": d.agents,
           "leftover": d.leftover, "last_step": max(rows, default=0),
           "faults": [{"kind": f.kind, "rank": f.rank, "node": f.rank // d.per_node, "step": f.step,
                       "resumed_from": f.resumed_from,
                       "steps_lost": None if f.resumed_from is None else f.step - 1 - f.resumed_from,
                       "restart_s": f.restart_s} for f in d.faults]}
    if ref is not None:
        want = last_rows(ref)
        out["reference_last_loss"] = want[max(want)]["loss"] if want else None
        out["last_loss"] = rows[max(rows)]["loss"] if rows else None
        out["losses_equal"] = bool(rows) and sorted(rows) == sorted(want) and all(
            rows[s]["loss"] == want[s]["loss"] for s in want)
    return out


def run(args: argparse.Namespace) -> int:
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    bad = [k for k in kinds if k not in FAULTS]
    try:
        if bad or not kinds:
            raise ValueError(f"--faults: each fault is one of {', '.join(FAULTS)}, got {args.faults!r}")
        if args.nodes < 2 or args.ranks_per_node < 1:
            raise ValueError(f"--nodes must be >= 2 and --ranks-per-node >= 1, got {args.nodes}, {args.ranks_per_node}")
        TrainConfig(cp=args.nodes, tp=args.ranks_per_node, seq_len=SEQ_LEN)  # the mesh's own one-line refusal
        faults = plan(args.nodes, args.ranks_per_node, args.steps, args.save_every, kinds, args.seed)
    except ValueError as err:
        print(f"flashpar bench drill: {err}", file=sys.stderr)
        return 2
    ok, why = links_available()
    if not ok:
        print(f"flashpar bench drill: {why}", file=sys.stderr)
        return 2
    out = Path(args.out)
    d = Drill(args.nodes, args.ranks_per_node, args.steps, args.save_every, faults, args.watchdog,
              len(faults) if args.max_restarts is None else args.max_restarts, out / "drill")
    print(f"drill: {d.nodes} nodes x {d.per_node} ranks, faults " + ", ".join(
        f"{f.kind} rank {f.rank} at step {f.step}" for f in faults), flush=True)
    run_drill(d, args.timeout)
    ref = reference(d, out / "reference") if args.reference else None
    rep = report(d, ref)
    for f in rep["faults"]:
        print(f"  {f['kind']:<4} rank {f['rank']} (node {f['node']}) at step {f['step']}: resumed from step "
              f"{f['resumed_from']} ({f['steps_lost']} steps lost), restart {_secs(f['restart_s'])} (fault to the "
              f"first step after it)")
    print(f"agents exited {rep['agents_exit']}; processes left in the namespaces: {len(rep['leftover'])}; last step "
          f"{rep['last_step']} of {d.steps}")
    if ref is not None:
        print(f"last loss {rep['last_loss']} vs {rep['reference_last_loss']} without faults: "
              f"{'equal at every step' if rep['losses_equal'] else 'DIFFERENT'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1))
    good = (all(a == 0 for a in d.agents) and not d.leftover and rep["last_step"] == d.steps
            and all(f["restart_s"] is not None for f in rep["faults"]) and rep.get("losses_equal", True))
    return 0 if good else 1


def _secs(s: float | None) -> str:
    return "never" if s is None else f"{s:.1f} s"

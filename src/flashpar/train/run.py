"""``flashpar train``: the Llama-style model on packed documents with TP-SP or Ulysses + CP + DP, in one command.

Without a launcher it checks the arguments, then spawns ``--nproc`` CPU processes on gloo (default:
the mesh's size, 4 for the default tp=2, cp=2).  Under ``torchrun`` (``RANK`` in the environment) every
process is one rank of the same job, with NCCL on GPUs when ``--device cuda``.  ``--check`` runs one step
of the mesh model against the single-process model instead of training and prints PASS / FAIL per parameter group.

Bad arguments (a mesh whose product is not the world size, heads / kv heads / FFN not
divisible by tp, heads Ulysses cannot split, ``--ulysses`` and ``--tp`` both > 1, a sequence too short
for the mesh, an unwritable output folder, no documents, a checkpoint made with other model or data
settings, ``--device cuda`` without CUDA, an ``--init-from`` folder whose config or weights flashpar cannot
use, a tokenizer that does not fit the model, a data file that cannot be read) stop with one line before
any process group starts
(``flashpar.train.config``).  A rank that fails makes the
launcher stop the others and print one line naming it and its log: each rank's output below
Python (torch's C++ warnings) and, but for rank 0's progress bar, its stderr go to ``rank<r>.log``
in ``--out`` (its first line: the rank, its pid and host, when it started), and a rank that raises ends its
log with the traceback.  Every wait has the ``--timeout``.
The spawned ranks end when the launcher ends, however it ends (SIGKILL included: ``flashpar.lifeline``);
Ctrl-C or SIGTERM stops them with one line naming the step and the checkpoint to resume from
(``flashpar.train.interrupt``).  Under torchrun none of this is added: torchrun's agent owns its workers.

From Python: ``launch(TrainConfig(...), hooks=Hooks(before_step=...))`` is the command without the
flags (``Hooks``: fault injection for drills and tests).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from flashpar.options import MODES, ParallelOptions
from flashpar.train import watchdog, where
from flashpar.train.config import TrainConfig, add_arguments, from_args, ready

if TYPE_CHECKING:
    from flashpar.train.loop import Hooks

__all__ = ["MODES", "add_arguments", "launch", "run"]


def rank_main(config: TrainConfig, hooks: Hooks | None = None) -> dict | None:
    """One rank: train, or check (returns rank 0's summary or check rows)."""
    if config.check:
        return _check(config)
    from flashpar.train.loop import train

    return train(config, hooks)


def _check(config: TrainConfig):
    import torch
    import torch.distributed as dist

    from flashpar.links import planning_device
    from flashpar.models.precision import CHECK_TOL
    from flashpar.train.check import CHECK_CLIP_RATIO, by_group, one_step
    from flashpar.train.data import training_data
    from flashpar.train.loop import setup
    from flashpar.train.planning import resolve_options

    device, mesh = setup(config)
    data = training_data(config)  # the byte corpus, or the tokens of --data / --tokenizer
    micro = config.check_micro_batches  # accumulation always exercised
    seqs = [(data[i]["tokens"], data[i]["labels"], data[i]["doc_lens"]) for i in range(micro * config.dp)]
    options = resolve_options(config, device.type, planning_device(device.type, config.tp * config.ulysses))
    errors = one_step(config.model, mesh, seqs, options, strategy=config.strategy, seed=config.seed,
                      micro_batches=micro, clip_ratio=CHECK_CLIP_RATIO, init_from=config.init_from, device=device)
    rows = by_group(errors, CHECK_TOL[config.dtype])
    worst = torch.tensor([max(e for _, e, _ in rows)], dtype=torch.float64, device=device)  # NCCL: a device tensor
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"rows": rows, "worst": float(worst), "micro_batches": micro} if dist.get_rank() == 0 else None


GRACE_S = 2.0
"""Seconds the other ranks get to exit after one failed, before they are killed (a stopped rank ignores
SIGTERM until killed; torch's default waits 30 s)."""

RAISED = 73  # a rank's exit status after an exception: its traceback ends its rank<r>.log
STOPPED = 74  # every rank stopped the job together (flashpar.train.stop.JobStop): its log ends with the one line


def _spawned(rank: int, world: int, rendezvous: dict, config: TrainConfig, result_path: str, hooks: Hooks | None,
             inherit, line) -> None:
    inherit.apply()  # the launcher's environment and stdout / stderr (flashpar.ranks: forked from a server)
    from flashpar.train.interrupt import ignore_in_rank

    ignore_in_rank()  # Ctrl-C reaches the whole process group: the launcher stops the ranks (flashpar.train.interrupt)
    os.environ.update(rendezvous, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # ranks.Rendezvous
    log = _own_stderr(rank, _rank_log(Path(config.out), rank))
    print(f"rank {rank} of {world}: pid {os.getpid()} on {socket.gethostname()}, started "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}", file=log, flush=True)  # every rank's log exists, and says whose
    line.watch(functools.partial(_launcher_gone, log, line.launcher_pid))  # flashpar.lifeline
    watchdog.report_to(log)  # its one line ends the log, which the launcher prints (_failure)
    import torch.distributed as dist

    from flashpar.train.stop import JobStop

    try:
        out = rank_main(config, hooks)
    except JobStop as err:  # the same line on every rank: the launcher prints it
        print(str(err), file=log, flush=True)
        os._exit(STOPPED)
    except BaseException as err:  # noqa: BLE001 - reported by the launcher from the log
        traceback.print_exc(file=log)
        late = _who_did_not_arrive(err)
        if late:
            log.write(late + "\n")
        log.flush()
        os._exit(RAISED)  # at once: tearing the group down could wait for peers that are mid-transfer with us
    if rank == 0:
        Path(result_path).write_text(json.dumps(out))
    if dist.is_initialized():
        dist.destroy_process_group()


def _worker_failed(err: BaseException) -> str:
    """A torchrun worker's report of ``err``: one line when a peer is gone (the peer's own report says why) or
    a wait timed out (who did not arrive); any other error: its traceback, then the line."""
    rank = os.environ.get("RANK", "?")
    stamps = where.mine()
    at = f" in step {stamps.step} {stamps.phase}" if stamps is not None and stamps.step else ""
    late = _who_did_not_arrive(err)
    if late:
        return f"flashpar train: rank {rank}{at}: {late}"
    if _peer_gone(err):
        first = (str(err).strip().splitlines() or [""])[0]
        return f"flashpar train: rank {rank}{at}: a peer is gone ({type(err).__name__}: {first}); this rank ends"
    return "".join(traceback.format_exception(err)) + f"flashpar train: rank {rank}{at}: {type(err).__name__}: {err}"


_PEER_GONE = ("connection reset by peer", "connection closed by peer", "broken pipe", "/gloo/transport/")


def _peer_gone(err: BaseException) -> bool:
    """``err`` (or what caused it) is a transport error: a peer's connection broke (it died, or its node did)."""
    import torch.distributed as dist

    return any(isinstance(e, dist.DistError) or any(s in str(e).lower() for s in _PEER_GONE) for e in _chain(err))


def _chain(err: BaseException | None):
    """``err`` and what caused it, outermost first."""
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


def _launcher_gone(log, pid: int) -> None:
    """The launcher died (killed: it could not stop the ranks itself): say so in the rank's log and end at once."""
    from flashpar.lifeline import exit_now

    exit_now(f"the launcher (pid {pid}) is gone", file=log)


def _who_did_not_arrive(err: BaseException) -> str:
    """For a wait that timed out: its error's first line and the ranks behind this one (``where.blame``), as one
    line; ``""`` for any other error."""
    late = where.blame() if _timed_out(err) else ""
    if not late:
        return ""
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first} -- {late}"


def _timed_out(err: BaseException) -> bool:
    """``err`` (or what caused it) is a distributed wait that ran out of time."""
    return any("timed out" in str(e).lower() or "timeout" in str(e).lower() for e in _chain(err))


def _rank_log(out: Path, rank) -> Path:
    return out / f"rank{rank}.log"


def _own_stderr(rank: int, path: Path):
    """Send this rank's file descriptor 2 to ``path``: torch's C++ warnings (when a rank dies, each peer
    prints some twenty lines of broken-pipe stack frames) and, on ranks > 0, Python's stderr.  Rank 0's
    Python stderr (the progress bar, warnings) stays on the launcher's terminal.  Returns the log."""
    log = open(path, "w", buffering=1)  # noqa: SIM115 - open for the life of the process
    if rank == 0:
        sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
    os.dup2(log.fileno(), 2)
    return log


def _failure(err, out: Path) -> str:
    """The one line for the rank that failed first: its exception and log, or how it died."""
    log = _rank_log(out, err.error_index)
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.is_file() else []
    if getattr(err, "exit_code", None) == RAISED and lines:
        return f"rank {err.error_index}: {lines[-1].strip()} (traceback: {log})"
    if getattr(err, "exit_code", None) in (STOPPED, watchdog.STALLED) and lines:
        return lines[-1].strip()
    return f"{err} (its output: {log})"


def run(args: argparse.Namespace) -> int:
    """``flashpar train`` with parsed flags: the exit status."""
    try:
        config = from_args(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"flashpar train: {err}", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:  # first, before the data checks and the ranks' start (seconds); torchrun: its own
        print(f"flashpar train: {_starting(config)}", flush=True)
    try:
        return launch(config)
    except KeyboardInterrupt:  # before the ranks started (checking the data, tokenizing): nothing to resume yet
        if "RANK" in os.environ:  # under torchrun: torchrun's agent reports it
            raise
        from flashpar.train.interrupt import EXIT_STATUS

        print("\nflashpar train: interrupted before the first step (while checking the run's data)", file=sys.stderr)
        return EXIT_STATUS


def _starting(config: TrainConfig) -> str:
    """What the command is about to do, in one line: the ranks, the mesh, the steps and the output folder."""
    ulysses = f", ulysses {config.ulysses}" if config.ulysses > 1 else ""
    work = "one --check step" if config.check else f"--steps {config.steps}"
    return (f"{config.nproc} ranks (dp {config.dp}, cp {config.cp}{ulysses}, tp {config.tp}), {work}, out "
            f"{config.out}: checking the data, then starting the ranks")


def launch(config: TrainConfig, hooks: Hooks | None = None) -> int:
    """Check the run's surroundings (``ready``), then run ``config.nproc`` spawned ranks, or this process as
    one rank under torchrun; print the report.  Exit status: 0 done, 1 a rank failed (or ``--check``
    failed), 2 bad settings.  ``hooks``: a ``flashpar.train.loop.Hooks``, run on every rank."""
    launched = time.perf_counter()  # the report's time "in all": checks, start-up, steps, saving
    world = int(os.environ.get("WORLD_SIZE", config.nproc))
    if "RANK" not in os.environ:  # before ready(), whose tokenizing pool would start an unquieted tracker
        from flashpar.ranks import quiet_tracker

        quiet_tracker()
    try:
        config = ready(config, world)
    except (ValueError, FileNotFoundError) as err:
        print(f"flashpar train: {err}", file=sys.stderr)
        return 2
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        from flashpar.train.stop import JobStop

        try:
            return _report(rank_main(config, hooks), config, time.perf_counter() - launched)
        except JobStop as err:
            print(f"flashpar train: {err}", file=sys.stderr)
            return 1
        except Exception as err:  # noqa: BLE001 - every failure ends this worker at once, in one line or two
            from flashpar.lifeline import exit_now

            # at once, NCCL's communicators aborted, as a spawned rank ends: tearing the group down could wait for
            # peers that are gone, and the peers still waiting on this rank then fail after it (their connections
            # close as it exits), so the agents see the first rank to fail end first and restart the job
            exit_now("", status=1, line=_worker_failed(err))
    import torch.multiprocessing as mp

    from flashpar import ranks
    from flashpar.lifeline import Lifeline
    from flashpar.train import interrupt

    out = Path(config.out)
    result = out / (".check.json" if config.check else ".result.json")  # rank 0's return
    result.unlink(missing_ok=True)
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")  # 'Terminating process ...': our line says it
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)
    rendezvous = ranks.Rendezvous(config.master_addr, config.timeout)  # listens on --master-addr only
    line = Lifeline()  # the ranks end when this process does, however it ends (flashpar.lifeline)
    procs, started = None, time.time()
    try:
        with interrupt.sigterm_interrupts():
            ranks.context()  # ranks fork from a server that has imported torch (flashpar.ranks)
            procs = mp.start_processes(_spawned, args=(config.nproc, rendezvous.env(), config, str(result), hooks,
                                                       ranks.Inherit(), line.child()),
                                       nprocs=config.nproc, join=False, start_method=ranks.start_method())
            while not procs.join(grace_period=GRACE_S):  # on a failure: the others get GRACE_S, then SIGKILL
                pass
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM: the ranks stop here, one line says where
        interrupt.stop_ranks(procs)
        print(f"\nflashpar train: {interrupt.line(out, config.save_every, err, started)}", file=sys.stderr)
        return interrupt.EXIT_STATUS
    except mp.ProcessExitedException as err:  # the first rank to stop: raised (its log), killed, or crashed
        stopped = getattr(err, "exit_code", None) == STOPPED
        print(f"flashpar train: {'' if stopped else 'a rank failed: '}{_failure(err, out)}", file=sys.stderr)
        return 1
    except mp.ProcessRaisedException as err:  # raised outside rank_main (starting up): the traceback is here
        print(f"flashpar train: a rank failed: rank {err.error_index}: {str(err).strip().splitlines()[-1]}",
              file=sys.stderr)
        return 1
    finally:
        spawn_log.setLevel(level)
        rendezvous.close()
        line.close()
    return _report(json.loads(result.read_text()), config, time.perf_counter() - launched)


def _report(out, config: TrainConfig, launch_s: float = float("nan")) -> int:
    if out is None:
        return 0
    if config.check:
        from flashpar.models.precision import CHECK_TOL

        ulysses = f"ulysses={config.ulysses} " if config.ulysses > 1 else ""
        recompute = ", activations checkpointed" if config.checkpoint_activations else ""
        recompute += ", compiled (--compile)" if config.compile else ""
        print(f"check: mesh dp={config.dp} ({config.dp_mode}) cp={config.cp} {ulysses}tp={config.tp}, "
              f"strategy {config.strategy}, mode {config.mode}{recompute}, one step of {out['micro_batches']} "
              f"micro-batches, gradients clipped to half their norm, against the single-process model (relative "
              f"error, {config.dtype} bound {CHECK_TOL[config.dtype]:.3g})")
        for name, err, ok in out["rows"]:
            print(f"  {'PASS' if ok else 'FAIL'}  {name:<16} {err:.2e}")
        passed = all(ok for _, _, ok in out["rows"])
        print("PASS" if passed else "FAIL")
        return 0 if passed else 1
    s = out
    ran_out = s.get("data_ran_out_at")
    if s["steps"] == 0:
        print(f"nothing to train: the training data hold no sequence after step {ran_out}" if ran_out is not None
              else f"nothing to train: the run is already at --steps {config.steps}")
        return 0
    mesh = " ".join(f"{k}={v}" for k, v in s["mesh"].items() if k != "ulysses" or v > 1)  # ulysses: when used
    rate = (f"MFU {s['mfu']:.1%}" if s.get("mfu") is not None else
            f"{s['model_flops_per_s'] / 1e9:.1f} GFLOP/s of model math (no MFU on CPU: no vendor peak)")
    print(f"\ntrained {s['steps']} steps on mesh {mesh}: {s['steps_s']:.1f} s in steps, {launch_s:.0f} s in all "
          f"(start-up, data, saving): loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}, "
          f"{s['tokens_per_s']:.0f} tokens/s (last {min(s['steps'], 5)} steps), {rate}, peak memory "
          f"{s['peak_mem_mb']:.0f} MB (largest rank, {s['dtype']}"
          f"{', activations checkpointed' if config.checkpoint_activations else ''})")
    print(f"{s['strategy']} plans: forward K/V {s['kv_bytes'] / 1e6:.1f} MB sent (plans: "
          f"{s['plan_kv_bytes'] / 1e6:.1f} MB) vs {s['per_doc_kv_bytes'] / 1e6:.1f} MB for per_doc and "
          f"{s['headtail_kv_bytes'] / 1e6:.1f} MB for headtail; estimated step (cost model) "
          f"{s['per_doc_est_step_ms'] / max(s['est_step_ms'], 1e-12):.2f}x faster than per_doc, "
          f"{s['headtail_est_step_ms'] / max(s['est_step_ms'], 1e-12):.2f}x than headtail")
    if s.get("options"):
        print(f"options: {ParallelOptions(**s['options']).describe()}")
    if s.get("compile_s") is not None:
        again = f", {s['recompiles']} graphs compiled again during the steps" if s["recompiles"] else ""
        print(f"compile: {s['compile_s']:.1f} s at start-up, {s['compile_graphs']} graphs, not in the step "
              f"times{again}")
    if ran_out is not None:
        print(f"the training data ran out at step {ran_out}, before --steps {config.steps} after --epochs "
              f"{config.epochs} pass{'es' if config.epochs > 1 else ''} (add documents, raise --epochs or lower "
              f"--steps)")
    if s.get("eval_loss") is not None:
        print(f"validation loss (held-out documents) {s['eval_loss']:.3f} at step {s['eval'][-1][0]}")
    if s.get("skipped_nonfinite"):
        print(f"skipped {len(s['skipped_nonfinite'])} steps with a non-finite loss or gradient norm (--skip-nonfinite "
              f"{config.skip_nonfinite}): steps {', '.join(map(str, s['skipped_nonfinite']))}")
    extra = [f"plot: {s['plot']}"] if s.get("plot") else []
    extra += [f"traces: {Path(s['out']) / 'trace_rank*.json'}"] if config.trace else []
    extra += [f"checkpoints: {Path(s['out']) / 'checkpoints'}"] if config.save_every else []
    print("; ".join([f"metrics: {Path(s['out']) / 'metrics.jsonl'}", f"summary: {Path(s['out']) / 'summary.json'}",
                     *extra]))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="flashpar train")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))

"""Drills: ``flashpar train``'s launcher killed with SIGKILL (no handler runs) mid-run and mid-save.

Within 15 s no process of the job remains: the processes are the launcher's process tree as the test records it
just before the kill (the four ranks, their data-loader workers, multiprocessing's fork server and resource
tracker), each identified by pid and start time, never by name.  A killed save leaves no ``step_N`` that a resume
would take, and ``--resume`` from the run's checkpoints continues.  The launcher is ``tests/lifeline_workers.py``
(``launch`` with a hook that holds rank 0 at a known point, see there).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="the drills read /proc (Linux)")

GONE_WITHIN_S = 15.0
START_WITHIN_S = 240.0  # four ranks importing torch on two loaded cores, then the first steps


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), None when gone or a zombie (it has ended)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _tree(root: int) -> dict[int, int]:
    """``root`` and every process descended from it: pid -> start time."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        started = _start_time(pid)
        if started is not None:
            out[pid] = started
            todo += children.get(pid, [])
    return out


def _alive(tree: dict[int, int]) -> list[int]:
    return [pid for pid, started in tree.items() if _start_time(pid) == started]


def _wait_gone(tree: dict[int, int], t0: float) -> float:
    """Wait until no process of ``tree`` is left, at most ``GONE_WITHIN_S`` after ``t0``: the seconds since ``t0``."""
    while _alive(tree) and time.monotonic() - t0 < GONE_WITHIN_S:
        time.sleep(0.1)
    return time.monotonic() - t0


def _reap(proc: subprocess.Popen, tree: dict[int, int]) -> None:
    """A failed drill leaves nothing running either."""
    for pid in _alive(tree):
        os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _kill_launcher_when_reached(tmp_path: Path, when: str, interrupt: bool = False) -> tuple[dict[int, int], float]:
    """Run the launcher until rank 0 holds at ``when``; record its tree, SIGKILL it (``interrupt``: SIGINT to its
    whole process group instead, as a terminal's Ctrl-C does); the tree and the seconds until no process of it
    was left.  With ``interrupt`` the launcher's stderr is kept in ``tmp_path / "stderr"``."""
    out = tmp_path / "run"
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent / "src"), str(here),
                                                         os.environ.get("PYTHONPATH", "")])}
    argv = [str(out), when, *(["small"] if interrupt else [])]  # Ctrl-C: 2 ranks are enough
    launcher = subprocess.Popen([sys.executable, str(here / "lifeline_workers.py"), *argv], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    tree: dict[int, int] = {}
    try:
        deadline = time.monotonic() + START_WITHIN_S
        while not (out / ".reached").is_file():
            assert launcher.poll() is None, launcher.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "rank 0 never reached the point of the drill"
            time.sleep(0.2)
        time.sleep(0.5)  # every rank inside the step's first collective, waiting for rank 0
        tree = _tree(launcher.pid)
        t0 = time.monotonic()
        if interrupt:
            os.killpg(launcher.pid, signal.SIGINT)
            _, err = launcher.communicate(timeout=GONE_WITHIN_S)
            (tmp_path / "stderr").write_text(f"{launcher.returncode}\n{err.decode()}")
        else:
            launcher.kill()
            launcher.wait()
        return tree, _wait_gone(tree, t0)
    finally:
        _reap(launcher, tree)


def _kinds(tree: dict[int, int]) -> str:
    cmds = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:90] for pid in tree
            if _start_time(pid) == tree[pid]]
    return "\n".join(cmds)


def test_killed_launcher_mid_run_leaves_no_process(tmp_path):
    tree, took = _kill_launcher_when_reached(tmp_path, "run")
    # the launcher, resource tracker, fork server, 4 ranks and their 4 data-loader workers
    assert len(tree) >= 11, f"recorded only {len(tree)} processes"
    left = _alive(tree)
    assert not left, f"{len(left)} processes of the job still run {took:.0f} s after the launcher died:\n{_kinds(tree)}"
    logs = [(tmp_path / "run" / f"rank{r}.log").read_text() for r in range(4)]
    assert all("is gone" in log and "Traceback" not in log for log in logs), logs


def test_ctrl_c_stops_the_job_with_one_line(tmp_path):
    """SIGINT to the job's process group with rank 0 inside step 3 (2 ranks): the launcher prints one line (where,
    the newest checkpoint, how to resume), no traceback anywhere, and no process of the job is left."""
    tree, took = _kill_launcher_when_reached(tmp_path, "run", interrupt=True)
    assert not _alive(tree), f"processes of the job still run {took:.0f} s after Ctrl-C"
    rc, err = (tmp_path / "stderr").read_text().split("\n", 1)
    last = err.strip().splitlines()[-1]
    assert rc == "130" and last == (f"flashpar train: interrupted at step 3; newest checkpoint step_2; resume with "
                                    f"--resume {tmp_path / 'run' / 'checkpoints'}"), err[-2000:]
    assert "Traceback" not in err and "Warning" not in err, err[-2000:]
    logs = [log.read_text() for log in (tmp_path / "run").glob("rank*.log")]
    assert not any("Traceback" in log for log in logs), logs


def test_killed_launcher_mid_save_leaves_no_step_and_resumes(tmp_path):
    from flashpar.train.run import launch
    from lifeline_workers import config

    tree, took = _kill_launcher_when_reached(tmp_path, "save")
    left = _alive(tree)
    assert not left, f"{len(left)} processes of the job still run {took:.0f} s after the launcher died"
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [".step_2.partial", "step_1"]  # step 2 never published
    # on one process (another mesh: checkpoints are resharded on load), the cheapest launch
    resumed = config(str(tmp_path / "resumed"), steps=3, workers=0, nproc=1, cp=1, tp=1, resume=str(checkpoints))
    assert launch(resumed) == 0
    rows = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [2, 3]


BENCH = ["--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "64", "--seq-len", "128",
         "--scale", "64", "--steps", "4", "--rounds", "200", "--warmup", "1", "--dp", "1", "--cp", "1", "--tp", "2"]


def _workers(tree: dict[int, int], launcher: int) -> list[int]:
    """The launcher's children that are benchmark ranks (their command line has --worker)."""
    return [pid for pid in tree if pid != launcher and b"--worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def test_killed_benchmark_leaves_no_worker_and_the_next_removes_its_namespaces(tmp_path, capfd):
    """``flashpar bench train`` SIGKILLed mid-round: its workers end within 15 s; behind emulated links (root) the
    next benchmark that builds links removes the namespaces the dead one left and says so in one line (without
    root: the same drill on loopback)."""
    from flashpar.bench import netlink

    links, _ = netlink.links_available()
    rate = "200mbit" if links else "none"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent / "src"),
                                                         os.environ.get("PYTHONPATH", "")])}
    bench = subprocess.Popen([sys.executable, "-m", "flashpar.cli", "bench", "train", *BENCH, "--link-rate", rate],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    tree: dict[int, int] = {}
    try:
        deadline = time.monotonic() + START_WITHIN_S
        while len(_workers(tree, bench.pid)) < 2:  # both ranks started ...
            assert bench.poll() is None, bench.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the benchmark's ranks never started"
            time.sleep(0.2)
            tree = _tree(bench.pid)
        time.sleep(8.0)  # ... and into their rounds (torch imported, the first steps run)
        tree = _tree(bench.pid)
        names = [n for n in netlink._netns_list() if netlink._owner(n) == bench.pid]
        t0 = time.monotonic()
        bench.kill()
        bench.wait()
        took = _wait_gone(tree, t0)
        left = _alive(tree)
        assert not left, f"{len(left)} processes still run {took:.0f} s after the benchmark died"
    finally:
        _reap(bench, tree)
    if not links:
        return
    assert len(names) == 3 and set(names) <= set(netlink._netns_list())  # r0, r1 and the hub, left behind
    capfd.readouterr()
    with netlink.EmulatedLinks(1, "1gbit"):
        # a hang-up removes the namespaces too, as SIGINT and SIGTERM do
        assert signal.getsignal(signal.SIGHUP) is netlink._on_signal
    err = capfd.readouterr().err
    assert f"removed 3 network namespaces left by a benchmark that is gone (pid {bench.pid})" in err, err
    assert not set(names) & set(netlink._netns_list())


def test_stale_namespace_names():
    """Ours by name (``fpnet<pid>-<serial>-r<rank>`` / ``-hub``), stale when the pid is gone or reused."""
    from flashpar.bench import netlink

    assert netlink._owner("fpnet1234-2-r3") == 1234 and netlink._owner("fpnet1234-1-hub") == 1234
    assert [netlink._owner(n) for n in ("fpnet1234-r3", "other7-1-r0", "fpnet12a-1-r0", "fpnet1-1-r0x")] == [None] * 4
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is free (not reused within this test: pids are handed out in increasing order)
    assert netlink._stale(f"fpnet{dead.pid}-1-r0", time.time())
    me = os.getpid()
    assert not netlink._stale(f"fpnet{me}-1-r0", time.time())  # this process's own
    parent = os.getppid()
    assert not netlink._stale(f"fpnet{parent}-1-hub", time.time())  # alive, started before the namespace
    assert netlink._stale(f"fpnet{parent}-1-hub", 0.0)  # made before its pid's process started: the pid was reused
    assert not netlink._stale("unrelated-ns", None)


def test_killed_generate_launcher_leaves_no_process(tmp_path):
    """``flashpar generate`` on 2 spawned ranks, its launcher killed with SIGKILL once its ranks run: within
    15 s no process of its tree remains."""
    transformers = pytest.importorskip("transformers")
    import torch

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps({"tokens": list(range(1, 40))}) for _ in range(8)))
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "flashpar.cli", "generate", "--no-progress", "--init-from", str(tmp_path / "llama"),
            "--prompts", str(tmp_path / "p.jsonl"), "--cp", "2", "--max-new-tokens", "3000",
            "--out", str(tmp_path / "out.jsonl")]
    launcher = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
    tree: dict[int, int] = {}
    try:
        deadline = time.monotonic() + START_WITHIN_S
        while len(_tree(launcher.pid)) < 4:  # the launcher, the fork server and the two ranks
            assert launcher.poll() is None, launcher.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.2)
        time.sleep(2.0)  # the ranks inside their work
        assert launcher.poll() is None, "generation ended before the drill"
        tree = _tree(launcher.pid)
        t0 = time.monotonic()
        launcher.kill()
        launcher.wait()
        _wait_gone(tree, t0)
        left = _alive(tree)
        assert not left, f"{len(left)} processes still run after the launcher died:\n{_kinds(tree)}"
    finally:
        _reap(launcher, tree)

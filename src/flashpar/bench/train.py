"""``flashpar bench train``: the trainer's configurations and torch's own stack side by side, in one run.

The parent validates the arguments (one line, exit 2, before any rank starts) and starts the ranks
behind the emulated links (``--link-rate``; each rank its own namespace and shaped veth, loopback
when not root), as ``bench cp`` and ``bench overlap`` do.  Every rank, for every configuration:

    flashpar   ParallelLlama: FlashOverlap ("flash") TP-SP, ZeRO-3 and Ulysses (where the mesh has
               them) fused with the GEMMs, FlashCP ("flashcp") plans    (flashpar.train.step)
    flashpar_compile  the same with ``--compile``: each block's elementwise regions compiled by torch.compile,
               the communicating ops eager (flashpar.models.regions; compiled before the first step, as the
               trainer does: flashpar.models.compiling)
    baseline   the same trainer with mode "none" (blocking collectives, blocking ZeRO-3) and
               "per_doc" plans
    torch      the same Llama in plain torch layers, parallelized with torch's APIs only, as
               torchtitan does (flashpar.bench.torch_parallel: DTensor TP-SP, FSDP2, per-document
               head-tail context parallelism with K/V all-gathered), attention per (document, chunk)
    torch_compile  the same, every block torch.compile'd whole after TP and before FSDP2, as torchtitan's
               apply_compile (flashpar.bench.compiled_blocks: with tp > 1 the embedding's async
               reduce-scatter awaited before the first compiled block, around a torch 2.13 bug)
    torch_dense    the dense-mask peer: one SDPA over all S_loc x S scores, torch 2.13's balancer order

(``--configs``: by default flashpar, baseline and torch.)

1. timing: every configuration built (same seed: the same initial weights as
   ``flashpar.train.step.build``), ``--warmup`` steps each, then ``--rounds`` rounds with the order
   rotated; in a round each configuration runs ``--steps`` steps as they are, then ``--steps`` steps
   inside :func:`flashpar.bench.no_comm.no_comm` (every collective and p2p call a local no-op: the
   same step with its communication skipped); every step starts after a barrier;
2. the breakdown: each configuration one plain step, then one step inside
   :func:`flashpar.bench.breakdown.breakdown` (its wall time split into attention forward / backward,
   linear, elementwise, loss, optimizer, exposed communication and other, measured where each happens);
   not of torch_compile (``WHOLE_GRAPHS``: its whole-block inductor graphs are invisible to the dispatch mode;
   flashpar_compile's regions are timed whole as elementwise);
3. memory and first loss: each configuration built fresh again, two optimizer steps on the same
   packed sequences; the first step's loss (summed over the ranks) and the rank's peak memory
   (``flashpar.peak_memory``).

Figures per configuration: ``step_ms`` the median over the timed steps of the slowest rank's step;
``exposed_ms`` = step - the median no-communication step (the communication the step does not hide);
``cpu_ms`` / ``no_comm_cpu_ms`` the median over the steps of the ranks' process CPU (every thread) summed,
and ``comm_cpu_ms`` their difference over the cores the ranks share (``min(cores, ranks x threads)``): the
wall time the transport's CPU work takes from the compute while the cores stay busy;
``tokens_per_s`` = dp x seq_len / step; ``mfu`` = model FLOPs of the step (``LlamaConfig.flops_per_token``
with the documents' causal pairs, as ``flashpar.train.loop``) / step / (peak FLOP/s per rank x ranks),
the peak from ``flashpar.cost.calibrate.peak_flops`` (a GEMM probe on every rank at once on CPU,
averaged over the ranks); ``peak_mem_mb`` the largest rank's peak; ``loss_step1``; ``breakdown_ms`` (each
part's mean over the ranks; ``breakdown_ms_per_rank``, ``breakdown_wall_ms`` the measured step,
``breakdown_step_ms`` the plain step before it); ``compile_s`` the seconds ``torch.compile`` spent building and
warming up the configuration (``flashpar.bench.compile_time``, the slowest rank; 0 for the eager ones) and
``recompiles`` the compilations during its timed steps (0: the warm-up absorbed them).  ``setup.hardware`` /
``attn_fwd`` / ``attn_bwd``: the cost model's calibration on this run's ranks (``calibrate_hardware``), from which
``flashpar simulate check`` predicts the step of every configuration.  The first-step losses must agree (relative
1e-4) or the command exits 1.

The data: ``--lengths`` (a shipped name or a file), each length divided by ``--scale``, packed into
``dp`` sequences of ``--seq-len`` tokens in units of ``2 cp`` tokens (torch's per-document head-tail
layout cuts every document into ``2 cp`` equal chunks, so every document piece is a multiple of
``2 cp``; the same documents for every configuration), tokens seeded random in the vocabulary, each
document's last token without a target.  Every step trains on the same sequences.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

from flashpar.peak_memory import peak_memory, reset_peak_memory
from flashpar.sim.bench_runs import model_config, packed_docs, torch_cp

CONFIGS = ("flashpar", "flashpar_compile", "baseline", "torch", "torch_compile", "torch_dense")
FLASHPAR = ("flashpar", "flashpar_compile", "baseline")  # the trainer's configurations (train_config)
DEFAULT_CONFIGS = ("flashpar", "baseline", "torch")
TORCH_PEERS = {"torch": ("docs", False), "torch_compile": ("docs", True), "torch_dense": ("dense", False)}
# the torch peers: (attention kernel of flashpar.bench.torch_attention, torch.compile per block)
COMPILED = ("flashpar_compile", "torch_compile")  # configurations that compile in their first steps: need a warm-up
WHOLE_GRAPHS = ("torch_compile",)  # compiled whole blocks: no breakdown (GEMMs, attention and the rest in one graph)
LOSS_RTOL = 1e-4  # fp32 on every path; the sums differ in order only (observed ~1e-7 relative)


# ----------------------------------------------------------------------------------------------
# the setup shared by the parent (validation) and the ranks


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark model's sizes (the default: a 12M-parameter Llama; docs/bench-train.md says why)."""
    p.add_argument("--hidden", type=int, default=512, help="(default 512)")
    p.add_argument("--layers", type=int, default=4, help="(default 4)")
    p.add_argument("--heads", type=int, default=8, help="(default 8)")
    p.add_argument("--kv-heads", type=int, default=4, help="(default 4)")
    p.add_argument("--ffn", type=int, default=1408, help="(default 1408)")


def train_config(config: dict, name: str):
    """The trainer's ``TrainConfig`` of configuration ``name`` (``FLASHPAR``)."""
    from flashpar.train.config import TrainConfig

    kw = {"dp": config["dp"], "cp": config["cp"], "ulysses": config["ulysses"], "tp": config["tp"],
          "nproc": world_size(config),
          "seq_len": config["seq_len"], "steps": 1, "lr": config["lr"], "seed": config["seed"],
          "model": model_config(config), "threads": config["threads"], "timeout": config["rank_timeout"],
          "dp_mode": "zero3", "workers": 0}
    if name in ("flashpar", "flashpar_compile"):
        return TrainConfig(**kw, mode="flash", strategy="flashcp", zero_schedule=config.get("zero_schedule", "auto"),
                           prefetch=config.get("prefetch", 1), compile=name == "flashpar_compile")
    return TrainConfig(**kw, mode="none", strategy="per_doc")


def dims(config: dict):
    """The flashpar mesh's sizes (``flashpar.dims.ParallelDims``: its rules, the mesh it builds)."""
    from flashpar.dims import ParallelDims

    return ParallelDims(config["dp"], config["cp"], config["ulysses"], config["tp"])


def world_size(config: dict) -> int:
    return dims(config).world_size


def sequences(config: dict):
    """``[(tokens [S], labels [S], doc_lens)]`` for the dp ranks: seeded random tokens, next-token labels inside
    each document (``-100`` on a document's last token)."""
    import torch

    from flashpar.models.llama import IGNORE

    out = []
    gen = torch.Generator().manual_seed(config["seed"] + 1)
    for doc_lens in packed_docs(config):
        tokens = torch.randint(0, model_config(config).vocab_size, (config["seq_len"],), generator=gen)
        labels = torch.roll(tokens, -1)
        labels[torch.tensor(doc_lens).cumsum(0) - 1] = IGNORE
        out.append((tokens, labels, doc_lens))
    return out


def step_flops(config: dict, seqs) -> float:
    """Model FLOPs of one step (``flashpar.train.loop``: tokens x flops_per_token(causal pairs / tokens))."""
    tokens = config["seq_len"] * config["dp"]
    pairs = sum(n * (n + 1) // 2 for _, _, lens in seqs for n in lens)
    return tokens * model_config(config).flops_per_token(pairs / tokens)


# ----------------------------------------------------------------------------------------------
# one configuration on one rank


class Runner:
    """One configuration built on this rank: ``step()`` is one optimizer step, returning this rank's loss share
    (the shares of all ranks add up to the mean next-token loss)."""

    def __init__(self, name: str, config: dict, seqs, meshes: dict) -> None:
        import torch

        from flashpar.models import Llama

        self.name = name
        cfg = model_config(config)
        count = float(sum(int((lab != -100).sum()) for _, lab, _ in seqs))
        device = torch.device("cpu")
        if name in TORCH_PEERS:
            from flashpar.bench import torch_parallel

            attention, compile_blocks = TORCH_PEERS[name]
            mesh = meshes["torch"]
            torch.manual_seed(config["seed"])  # flashpar.train.step.build's weights
            full = Llama(cfg)
            self.model, self.opt = torch_parallel.build(cfg, mesh, full, device, lr=config["lr"],
                                                        compile_blocks=compile_blocks)
            tokens, labels, doc_lens = seqs[mesh["dp"].get_local_rank()]
            batch = torch_parallel.make_batch(tokens, labels, doc_lens, mesh, device, attention)
            tp = mesh["tp"].size()
            self._step = lambda: torch_parallel.train_step(self.model, self.opt, batch, count, tp)
            return
        from flashpar import cp
        from flashpar.links import planning_device
        from flashpar.models.compiling import warm_up
        from flashpar.train.planning import planner_cost, resolve_options
        from flashpar.train.step import build, train_step

        tc = train_config(config, name)
        mesh = meshes["flashpar"]
        options = resolve_options(tc, device.type, planning_device(device.type, tc.tp * tc.ulysses))
        _, self.model, self.opt = build(tc, mesh, device, options)
        warm_up(self.model)  # flashpar_compile: the regions compiled here, as the trainer does before its steps
        tokens, labels, doc_lens = seqs[mesh["dp"].get_local_rank()]
        cost = planner_cost(cfg, group=tc.tp * tc.ulysses)  # as flashpar.train.loop (burst: core_burst)
        plan = cp.plan(doc_lens, tc.cp, strategy=tc.strategy, cost=cost)
        cp_rank = mesh["cp"].get_local_rank()
        tokens_cp, labels_cp = cp.shard(tokens, plan, cp_rank), cp.shard(labels, plan, cp_rank)
        self._step = lambda: train_step(self.model, self.opt, tokens_cp, labels_cp, plan, count)

    def step(self):
        return self._step()


def make_meshes(config: dict) -> dict:
    """The trainer's mesh (``flashpar.train.loop.setup``: dp, cp, [ulysses,] tp) and the torch peer's."""
    import torch

    from flashpar.bench.torch_parallel import make_mesh
    from flashpar.train.loop import setup

    meshes = {}
    if set(FLASHPAR) & set(config["configs"]):
        _, meshes["flashpar"] = setup(train_config(config, "flashpar"))
    else:
        torch.set_num_threads(config["threads"])
    if set(TORCH_PEERS) & set(config["configs"]):
        meshes["torch"] = make_mesh(config["dp"], torch_cp(config), config["tp"], "cpu")
    return meshes


# ----------------------------------------------------------------------------------------------
# measuring


def _timed(step, barrier) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds: every thread, gloo's included) of one step after a barrier."""
    barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    step()
    return time.perf_counter() - t0, time.process_time() - c0


def _record(samples: dict, name: str, kind: str, timings: list[tuple[float, float]]) -> None:
    samples[(name, kind)] += [wall for wall, _ in timings]
    samples[(name, kind + "_cpu")] += [cpu for _, cpu in timings]


def worker(config: dict) -> None:
    import torch
    import torch.distributed as dist

    from flashpar.bench.breakdown import breakdown, timed_model
    from flashpar.bench.compile_time import compile_seconds, compiles
    from flashpar.bench.no_comm import no_comm
    from flashpar.cost.calibrate import peak_flops
    from flashpar.dist import as_timedelta

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # FSDP2 on the embedding's output
    warnings.filterwarnings("ignore", message=".*sequential all_gather.*")
    dist.init_process_group("gloo", timeout=as_timedelta(config["rank_timeout"]))
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(config["threads"])
    seqs = sequences(config)
    meshes = make_meshes(config)
    names = config["configs"]

    # 1. timing: every configuration built, warmed up, then rounds with the order rotated; torch.compile's time
    #    in each configuration's build and warm-up is its compile_s (flashpar.bench.compile_time)
    runners, compile_s, recompiles = {}, dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
    for name in names:
        c0 = compile_seconds()
        runners[name] = Runner(name, config, seqs, meshes)
        compile_s[name] += compile_seconds() - c0
    for name in names:
        c0 = compile_seconds()
        for _ in range(config["warmup"]):
            runners[name].step()
        if config["warmup"]:  # once without communication too: torch.compile's graphs are specialised on the
            with no_comm():  # collectives they call, so the first step inside no_comm() recompiles
                runners[name].step()
        compile_s[name] += compile_seconds() - c0
    peak = torch.tensor([peak_flops(torch.device("cpu"))], dtype=torch.float64)
    dist.all_reduce(peak)
    hardware = calibrate_hardware(config)  # for `flashpar simulate check` (flashpar.sim.check_train)
    samples = {(name, kind): [] for name in names for kind in ("step", "no_comm", "step_cpu", "no_comm_cpu")}
    barrier = dist.barrier
    for rnd in range(config["rounds"]):
        order = names[rnd % len(names):] + names[: rnd % len(names)]
        for name in order:
            step = runners[name].step
            k0 = compiles()
            _record(samples, name, "step", [_timed(step, barrier) for _ in range(config["steps"])])
            with no_comm():
                _record(samples, name, "no_comm", [_timed(step, barrier) for _ in range(config["steps"])])
            recompiles[name] += compiles() - k0  # a compilation inside a timed step: 0 after the warm-up
    # the breakdown: one more step of each configuration with its parts timed (flashpar.bench.breakdown), right
    # after a plain step of the same configuration (the step its parts are compared with: the load of the moment);
    # not of torch_compile: its blocks run as whole inductor graphs, which the breakdown's dispatch mode does not
    # see, and under that mode dynamo runs no compiled frame (with fullgraph=True it raises); flashpar_compile's
    # regions are elementwise only: each call and its backward node timed whole (timed_model)
    parts = {}
    with breakdown():  # the dispatch mode's first entry costs ~0.1 s once: not charged to the first configuration
        torch.ones(1).add(1)
    for name in (n for n in names if n not in WHOLE_GRAPHS):
        plain, _ = _timed(runners[name].step, barrier)
        barrier()
        with breakdown(optimizers=[runners[name].opt]) as clock, timed_model(runners[name].model, clock):
            clock.restart()  # the step alone: entering and leaving the block are not the step's
            runners[name].step()
            measured = clock.finish()
        parts[name] = {**measured, "plain_ms": 1e3 * plain}
    del runners, step

    # 2. memory and first-step loss: each configuration built fresh (after the timing, so that one-time
    #    allocations of the process -- imports, thread pools, groups' buffers -- are not charged to the first)
    first, mem = {}, {}
    for name in names:
        dist.barrier()
        before = reset_peak_memory()
        runner = Runner(name, config, seqs, meshes)
        losses = [runner.step() for _ in range(2)]
        mem[name] = peak_memory(before)
        first[name] = losses[0].detach().double().reshape(1)
        del runner, losses
    loss_sum = torch.cat([first[name] for name in names])
    dist.all_reduce(loss_sum)
    gathered = [None] * n
    dist.all_gather_object(gathered, {"samples": samples, "mem": mem, "parts": parts, "compile_s": compile_s,
                                      "recompiles": recompiles})
    if rank == 0:
        report = make_report(config, gathered, loss_sum.tolist(), float(peak) / n, seqs, hardware)
        with open(config["out"], "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def calibrate_hardware(config: dict) -> dict:
    """This machine as the cost model sees it, measured on every rank at once after the warm-up (as ``bench
    overlap`` and ``bench cp`` calibrate): GEMM rate and the executor's overheads, the link, memory
    (``flashpar.cost.calibrate.calibrate``), and the CPU flash kernel's forward and backward curves at one
    rank's heads (``calibrate_attention``).  ``{"hardware": Hardware fields, "attn_fwd" / "attn_bwd":
    {attn_peak, attn_half}}``, rank 0's values."""
    import dataclasses

    import torch

    from flashpar.bench.overlap import measure_schedule_overheads
    from flashpar.cost.calibrate import calibrate, calibrate_attention

    hw = calibrate(dtype=torch.float32, overheads=measure_schedule_overheads)
    cfg, split = model_config(config), config["tp"] * config["ulysses"]
    fwd, bwd = calibrate_attention(hw, max(cfg.heads // split, 1), max(cfg.kv_heads // split, 1), cfg.head_dim,
                                   torch.float32)
    curve = lambda h: {"attn_peak": h.attn_peak, "attn_half": h.attn_half}  # noqa: E731
    return {"hardware": dataclasses.asdict(hw), "attn_fwd": curve(fwd), "attn_bwd": curve(bwd)}


def make_report(config: dict, gathered: list, losses: list[float], peak_per_rank: float, seqs,
                hardware: dict | None = None) -> dict:
    import dataclasses

    from flashpar.cost import store as cost_store
    from flashpar.links import core_burst, host_cores

    names, n = config["configs"], len(gathered)
    flops = step_flops(config, seqs)
    tokens = config["seq_len"] * config["dp"]
    cores = host_cores()  # the cores core_burst counts (affinity, container quota), as simulate check reads them
    shared = min(cores, n * config["threads"])  # the cores the ranks' threads share
    rows = []
    for name, loss in zip(names, losses, strict=True):
        med, cpu = {}, {}
        for kind in ("step", "no_comm"):
            per_step = zip(*(g["samples"][(name, kind)] for g in gathered), strict=True)
            med[kind] = statistics.median(max(ts) for ts in per_step)
            per_step = zip(*(g["samples"][(name, kind + "_cpu")] for g in gathered), strict=True)
            cpu[kind] = statistics.median(sum(cs) for cs in per_step)
        rows.append({"name": name, "tokens_per_s": tokens / med["step"], "step_ms": 1e3 * med["step"],
                     "exposed_ms": 1e3 * (med["step"] - med["no_comm"]), "no_comm_ms": 1e3 * med["no_comm"],
                     "cpu_ms": 1e3 * cpu["step"], "no_comm_cpu_ms": 1e3 * cpu["no_comm"],
                     "comm_cpu_ms": 1e3 * (cpu["step"] - cpu["no_comm"]) / shared,
                     "mfu": flops / med["step"] / (peak_per_rank * n),
                     "peak_mem_mb": max(g["mem"][name] for g in gathered), "loss_step1": loss,
                     **compile_figures(gathered, name),
                     **breakdown_figures([g["parts"][name] for g in gathered] if name in gathered[0].get("parts", {})
                                         else [])})
    ref = losses[0]
    worst = max(abs(x - ref) / abs(ref) for x in losses)
    setup = {key: config[key] for key in ("dp", "cp", "ulysses", "tp", "hidden", "layers", "heads", "kv_heads",
                                          "ffn", "seq_len", "lengths", "scale", "steps", "rounds", "warmup",
                                          "threads", "lr", "seed", "link_rate")}
    setup.update(world_size=n, documents=[len(lens) for _, _, lens in seqs], flops_per_step=flops,
                 peak_flops_per_rank=peak_per_rank, params=model_config(config).params,
                 loss_rel_diff=worst, losses_agree=worst <= LOSS_RTOL, torch_cp=torch_cp(config),
                 cores=cores, regather=train_config(config, "flashpar").regather,
                 gather_vocab=True,  # ParallelLlama's default (flashpar.models.vocab.gathers_weight)
                 plan_hardware=dataclasses.asdict(cost_store.load("cpu")),  # what Runner's planner_cost(cfg) read
                 plan_burst=core_burst("cpu", config["tp"] * config["ulysses"]),  # and the ranks sharing cores
                 **(hardware or {}),
                 peak_mem="CPU: rise of the rank's peak resident set (VmHWM, reset via /proc/self/clear_refs) over "
                          "its resident set before building, 2 steps of a fresh build; largest rank")
    return {"setup": setup, "configs": rows}


def compile_figures(gathered: list, name: str) -> dict:
    """``compile_s`` (the slowest rank's seconds of ``torch.compile`` in the configuration's build and warm-up)
    and ``recompiles`` (the most compilations a rank did in its timed steps); ``{}`` for ranks that did not
    report them."""
    if "compile_s" not in gathered[0]:
        return {}
    return {"compile_s": max(g["compile_s"][name] for g in gathered),
            "recompiles": max(g["recompiles"][name] for g in gathered)}


def breakdown_figures(per_rank: list[dict], parts: tuple[str, ...] | None = None, plain: str = "step") -> dict:
    """``breakdown_ms`` (each part's mean over the ranks; ``parts``, default ``breakdown.PARTS``),
    ``breakdown_ms_per_rank``, ``breakdown_wall_ms`` (the mean over the ranks of the measured step's wall time,
    which the parts add up to) and ``breakdown_<plain>_ms`` (the same of the plain step just before it, which
    they are compared with)."""
    from flashpar.bench.breakdown import PARTS

    if not per_rank:
        return {}
    parts = parts or PARTS
    n = len(per_rank)
    return {"breakdown_ms": {p: sum(r[p] for r in per_rank) / n for p in parts},
            "breakdown_ms_per_rank": [{p: r[p] for p in parts} for r in per_rank],
            "breakdown_wall_ms": sum(r["wall_ms"] for r in per_rank) / n,
            f"breakdown_{plain}_ms": sum(r.get("plain_ms", r["wall_ms"]) for r in per_rank) / n}


def format_breakdown(rows: list[dict]) -> list[str]:
    """The parts of each configuration's measured step (mean over the ranks); their sum against the plain step run
    just before it (``sum/step``) and against the timed median step (``sum/median``)."""
    from flashpar.bench.breakdown import PARTS

    rows = [r for r in rows if "breakdown_ms" in r]
    if not rows:
        return []
    short = {"attention_fwd": "attn fwd", "attention_bwd": "attn bwd", "exposed_comm": "comm"}
    lines = ["", "where the step goes (ms, mean over the ranks of one more step, timed by part: "
                 "flashpar.bench.breakdown)",
             f"{'config':<17}" + "".join(f"{short.get(p, p):>12}" for p in PARTS)
             + f"{'sum':>9}{'sum/step':>9}{'sum/median':>11}"]
    for r in rows:
        b = r["breakdown_ms"]
        total = sum(b.values())
        lines.append(f"{r['name']:<17}" + "".join(f"{b[p]:>12.0f}" for p in PARTS)
                     + f"{total:>9.0f}{total / r['breakdown_step_ms']:>9.2f}{total / r['step_ms']:>11.2f}")
    return lines


# ----------------------------------------------------------------------------------------------
# parent


def format_report(report: dict) -> str:
    s, rows = report["setup"], report["configs"]
    by = {r["name"]: r for r in rows}
    lines = [
        f"N={s['world_size']} (dp {s['dp']} x cp {s['cp']} x ulysses {s['ulysses']} x tp {s['tp']}), link "
        f"{s['link_rate']}, Llama hidden {s['hidden']} x {s['layers']} layers, heads {s['heads']}/{s['kv_heads']}, "
        f"ffn {s['ffn']} ({s['params'] / 1e6:.2f}M params), {s['seq_len']} tokens per dp rank "
        f"({s['lengths']} / {s['scale']}: {s['documents']} documents), fp32, {s['threads']} thread(s)/rank",
        f"median of {s['rounds']} rounds x {s['steps']} steps (slowest rank per step), {s['warmup']} warm-up steps; "
        f"peak {s['peak_flops_per_rank'] / 1e9:.1f} GFLOP/s per rank",
        *([f"calibration (setup.hardware, for `flashpar simulate check`): GEMM {s['hardware']['flops'] / 1e9:.1f} "
           f"GFLOP/s, link {s['hardware']['link_bytes_per_s'] / 1e6:.1f} MB/s, "
           f"{1e6 * s['hardware']['link_latency_s']:.0f} us per message"] if "hardware" in s else []),
        "",
        f"{'config':<17}{'tokens/s':>10}{'step ms':>9}{'no-comm':>9}{'exposed':>9}{'exp %':>7}{'comm CPU':>9}"
        f"{'MFU %':>7}{'mem MB':>8}{'loss step 1':>13}{'x baseline':>11}{'x torch':>9}{'compile s':>10}",
    ]
    for r in rows:
        ratio = lambda base, r=r: f"{r['tokens_per_s'] / by[base]['tokens_per_s']:.2f}" if base in by else "-"  # noqa: E731
        comm_cpu = f"{r['comm_cpu_ms']:>9.0f}" if "comm_cpu_ms" in r else f"{'-':>9}"  # reports without the field: none
        lines.append(f"{r['name']:<17}{r['tokens_per_s']:>10.0f}{r['step_ms']:>9.0f}{r['no_comm_ms']:>9.0f}"
                     f"{r['exposed_ms']:>9.0f}{100 * r['exposed_ms'] / r['step_ms']:>7.1f}{comm_cpu}"
                     f"{100 * r['mfu']:>7.2f}"
                     f"{r['peak_mem_mb']:>8.1f}{r['loss_step1']:>13.7f}{ratio('baseline'):>11}{ratio('torch'):>9}"
                     f"{r.get('compile_s', 0.0):>10.1f}")
    lines += format_pairs(by)
    lines += format_breakdown(rows)
    lines += format_recompiles(rows)
    agree = "agree" if s["losses_agree"] else "DISAGREE"
    lines.append(f"first-step losses {agree}: largest relative difference {s['loss_rel_diff']:.2e} "
                 f"(tolerance {LOSS_RTOL:g})")
    return "\n".join(lines)


PAIRS = (("flashpar_compile", "torch_compile"), ("flashpar_compile", "flashpar"), ("flashpar", "torch"))
"""The throughput ratios a run states when it has both sides: each method against the peer built the same way
(compiled against compiled, eager against eager) and compilation's own gain."""


def format_pairs(by: dict[str, dict]) -> list[str]:
    """One line of ``PAIRS``' throughput ratios (those whose two configurations ran), or none."""
    found = [f"{a} / {b} {by[a]['tokens_per_s'] / by[b]['tokens_per_s']:.2f}x" for a, b in PAIRS if a in by and b in by]
    return [f"tokens/s ratios: {', '.join(found)}"] if found else []


def format_recompiles(rows: list[dict]) -> list[str]:
    """One line naming the configurations that compiled during timed steps (none after a sufficient warm-up)."""
    late = [f"{r['name']} ({r['recompiles']})" for r in rows if r.get("recompiles")]
    return [f"compiled during timed steps (their step times include it): {', '.join(late)}"] if late else []


def add_arguments(p: argparse.ArgumentParser) -> None:
    from flashpar.cp.lengths import LENGTHS_HELP

    p.add_argument("--dp", type=int, default=1, help="data-parallel size (default 1)")
    p.add_argument("--cp", type=int, default=2, help="context-parallel size (default 2)")
    p.add_argument("--ulysses", type=int, default=1, help="Ulysses size of flashpar's mesh (default 1)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    # the default setup (docs/bench-train.md says why): a 12M-parameter Llama on 8192-token sequences at 2gbit
    add_model_arguments(p)
    p.add_argument("--seq-len", type=int, default=8192, help="tokens per packed sequence (per dp rank; default 8192)")
    p.add_argument("--link-rate", default="2gbit",
                   help="emulated per-rank link (tc rate); 'none' = loopback (default 2gbit, docs/bench-train.md)")
    p.add_argument("--lengths", default="wlbllm", help=LENGTHS_HELP + " (default wlbllm)")
    p.add_argument("--scale", type=int, default=16, help="divide every document length by this (default 16)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per configuration and round (default 2)")
    p.add_argument("--rounds", type=int, default=5, help="rounds, the order rotated (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration first (default 2)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"subset of {','.join(CONFIGS)} (default {','.join(DEFAULT_CONFIGS)})")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--zero-schedule", default="auto", choices=("auto", "prefetch", "fused"),
                   help="flashpar's ZeRO-3 schedule per block, as flashpar train's (default auto)")
    p.add_argument("--prefetch", type=int, default=1, help="flashpar's ZeRO-3 blocks gathered ahead (default 1)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (the trainer's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report to this JSON file")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run")


def config_of(args: argparse.Namespace) -> dict:
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    return {"dp": args.dp, "cp": args.cp, "ulysses": args.ulysses, "tp": args.tp, "hidden": args.hidden,
            "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads, "ffn": args.ffn,
            "seq_len": args.seq_len, "lengths": args.lengths, "scale": args.scale, "steps": args.steps,
            "rounds": args.rounds, "warmup": args.warmup, "configs": configs, "threads": args.threads,
            "lr": args.lr, "seed": args.seed, "rank_timeout": min(args.timeout, 600.0),
            "zero_schedule": args.zero_schedule, "prefetch": args.prefetch}


def check_arguments(config: dict) -> str | None:
    """The first problem with the arguments, as one line, or ``None`` (checked before any rank starts)."""
    unknown = [c for c in config["configs"] if c not in CONFIGS]
    if unknown or not config["configs"] or len(set(config["configs"])) != len(config["configs"]):
        return f"--configs: expected distinct names from {','.join(CONFIGS)}, got {','.join(config['configs'])!r}"
    for key, least in (("dp", 1), ("cp", 1), ("ulysses", 1), ("tp", 1), ("hidden", 1), ("layers", 1),
                       ("heads", 1), ("kv_heads", 1), ("ffn", 1), ("seq_len", 1), ("scale", 1), ("steps", 1),
                       ("rounds", 1), ("warmup", 0), ("threads", 1)):
        if config[key] < least:
            return f"--{key.replace('_', '-')} must be >= {least}, got {config[key]}"
    if world_size(config) < 2:
        return "the mesh dp x cp x ulysses x tp must have at least 2 ranks"
    compiled = [c for c in config["configs"] if c in COMPILED]
    if compiled and config["warmup"] < 1:
        return (f"--warmup 0: {','.join(compiled)} compiles in its first steps, which would be timed; "
                "give --warmup 1 or more")
    try:
        model_config(config)
        for name in FLASHPAR:
            if name in config["configs"]:
                train_config(config, name)
    except ValueError as err:
        return str(err).splitlines()[0]
    unit = 2 * dims(config).seq_ranks  # (cp x ulysses x tp: torch_cp x tp)
    if config["seq_len"] % unit:
        return (f"--seq-len {config['seq_len']} must be a multiple of 2 x cp x ulysses x tp = {unit} (torch's "
                "per-document head-tail chunks, then tp's sequence shards)")
    try:
        packs = packed_docs(config)
    except (OSError, ValueError) as err:
        return f"--lengths: {err}"
    if len(packs) < config["dp"]:
        return (f"--lengths {config['lengths']} / {config['scale']} fills {len(packs)} sequences of "
                f"{config['seq_len']} tokens, dp needs {config['dp']}")
    return None


def run(args: argparse.Namespace) -> int:
    from flashpar.bench.launch import run_workers, save_json
    from flashpar.bench.netlink import chosen_rate, rate_problem

    config = config_of(args)
    problem = check_arguments(config) or rate_problem(args.link_rate)
    if problem:
        print(f"flashpar bench train: {problem}", file=sys.stderr)
        return 2
    rate = chosen_rate(args.link_rate)
    report = run_workers("flashpar.bench.train", world_size(config), config, rate, timeout=args.timeout)
    report["setup"]["command"] = "flashpar bench train " + " ".join(sys.argv[3:] if len(sys.argv) > 2 else [])
    print(format_report(report), flush=True)
    save_json(args.json, report)
    if not report["setup"]["losses_agree"]:
        print("flashpar bench train: the first-step losses disagree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from flashpar.bench.launch import module_main

    module_main("flashpar bench train", add_arguments, run, worker)


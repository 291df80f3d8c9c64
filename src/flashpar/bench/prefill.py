"""``flashpar bench prefill``: inference side by side, one packed batch of prompts on a (tp, cp) mesh behind the
emulated links (``--link-rate``), as ``bench train`` runs its configurations:

    flashpar   ``flashpar.infer``: FlashOverlap TP-SP linears (``--mode``, default "auto": the decomposition
               per shape, blocking where a GEMM is too short to hide a transfer; "flash": always
               decomposed), FlashCP plans made with the forward-only cost model, the sharded cache,
               context-parallel decode
    flashpar_compile  the same with ``--compile``: the prefill's elementwise regions compiled by torch.compile
               before the first run (``flashpar.models.regions``; the communicating ops and decode eager)
    baseline   the same path with mode "none" (blocking collectives) and "per_doc" plans (every prompt cut
               into 2 cp head-tail chunks, all K/V all-gathered)
    torch      the ``bench train`` peer forward-only (``flashpar.bench.torch_prefill``: DTensor TP-SP, K/V
               all-gathered over cp, SDPA per (document, chunk) of torch's per-document head-tail layout, the
               head on the prompts' last tokens); prefill only: it has no KV cache to decode from
    torch_compile  the same peer, every block torch.compile'd as ``bench train``'s compiled peer
               (``flashpar.bench.compiled_blocks``; forward-only graphs: the peer runs under no_grad)

The batch: ``--lengths`` (a shipped name, a file, or a comma list of lengths) divided by ``--scale``, packed into
one sequence of ``--tokens`` tokens in units of ``2 cp`` (torch's head-tail chunks), each document one prompt of
seeded random tokens.  Every configuration built once, ``--warmup`` runs, then ``--rounds`` rounds with the order
rotated; a run is the prefill and ``--decode-steps`` decode steps (greedy).  Then one more time to first token of
each configuration, timed by part (``time_parts``; not of a compiled one), and each configuration again, fresh, for
its peak memory.  Figures per configuration (medians over rounds of the slowest rank): ``ttft_ms`` (planning, the
cache's set-up, prefill and the first token; torch: its forward to the first token), ``prefill_tokens_per_s`` (the
batch's tokens / ttft), ``decode_tokens_per_s`` (prompts x steps / decode time), ``kv_bytes`` (the largest rank's
K/V at the end; torch: the K/V a rank all-gathers per layer, times the layers, what a cache of it would hold),
``peak_mem_mb``; ``breakdown_ms`` (``PARTS``, each part's mean over the ranks; ``breakdown_ms_per_rank``,
``breakdown_wall_ms`` the timed run, which the parts add up to, ``breakdown_ttft_ms`` the plain run before it),
``breakdown_cpu_ms`` (each part's CPU time, the stepping thread) and ``breakdown_process_cpu_ms`` (every thread);
``compile_s`` (the seconds ``torch.compile`` spent in the configuration's build and warm-up, the slowest rank:
``flashpar.bench.compile_time``; 0 for the eager ones) and ``recompiles`` (compilations during its timed runs). The
first logits (every prompt's last token) must agree across the configurations (relative 1e-4) or the command exits
1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from flashpar.bench.train import COMPILED, WHOLE_GRAPHS  # the same configurations compile (bench train's sets)

CONFIGS = ("flashpar", "flashpar_compile", "baseline", "torch", "torch_compile")
DEFAULT_CONFIGS = ("flashpar", "baseline", "torch")
TORCH_PEERS = {"torch": False, "torch_compile": True}  # the torch peers: torch.compile per block
LOGITS_RTOL = 1e-4  # fp32 on every path, sums in another order only


def model_config(config: dict):
    """bench train's Llama (untied), with positions for the batch and its decode steps."""
    from flashpar.sim.bench_runs import model_config as bench_model

    return bench_model(config, max_positions=max(2048, config["tokens"] + config["decode_steps"] + 1))


def prompt_lengths(config: dict) -> list[int]:
    """The batch's prompt lengths: ``--lengths`` / ``--scale`` packed into ``--tokens`` in units of ``2 cp``."""
    from flashpar.cp.lengths import Lengths, resolve_lengths

    unit = 2 * config["cp"]
    spec = config["lengths"]
    if spec.replace(",", "").strip().isdigit():
        source = Lengths("list", values=tuple(int(x) for x in spec.split(",") if x.strip()))
    else:
        source = resolve_lengths(spec)
    packs = source.packs(config["tokens"] // unit, 1, seed=config["seed"], scale=config["scale"] * unit)
    if not packs:
        raise ValueError(f"--lengths {spec} / {config['scale']} does not fill a sequence of {config['tokens']} tokens")
    return [n * unit for n in packs[0]]


def prompts(config: dict):
    import torch

    gen = torch.Generator().manual_seed(config["seed"] + 1)
    vocab = model_config(config).vocab_size
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in prompt_lengths(config)]


class Runner:
    """One configuration on this rank: ``run()`` -> ``(ttft_s, decode_s, kv_bytes, first logits [P, V])``;
    ``first_token()``: the time to first token's work alone (what the breakdown times)."""

    def __init__(self, name: str, config: dict, ids, full, meshes: dict) -> None:
        self.name, self.config, self.ids = name, config, ids
        if name in TORCH_PEERS:
            from flashpar.bench.torch_prefill import TorchPrefill

            self.peer = TorchPrefill(full, meshes["torch"], ids, compile_blocks=TORCH_PEERS[name])
            return
        from flashpar.infer.planning import forward_cost
        from flashpar.models.compiling import warm_up
        from flashpar.models.parallel import ParallelLlama

        ours = name != "baseline"
        self.model = ParallelLlama(full.cfg, meshes["flashpar"], mode=config["mode"] if ours else "none",
                                   dp_mode="replicate", compile=name == "flashpar_compile",
                                   timeout=config["rank_timeout"])
        self.model.load_full(full)
        warm_up(self.model, grad=False)  # flashpar_compile: its regions compiled here, as flashpar generate does
        self.cost = forward_cost(full.cfg, self.model.options.dtype_bytes, "cpu", config["tp"])
        self.strategy = "flashcp" if ours else "per_doc"

    def run(self):
        if self.name in TORCH_PEERS:
            ttft, first, _ = self.peer.run()
            return ttft, None, self.peer.kv_bytes(), first
        from flashpar.infer import generate

        out = generate(self.model, self.ids, max_new_tokens=self.config["decode_steps"] + 1, strategy=self.strategy,
                       cost=self.cost, keep_logits=True)
        return out.ttft_s, out.decode_s, out.kv_bytes, out.first_logits

    def first_token(self) -> None:
        if self.name in TORCH_PEERS:
            self.peer.first_token()
            return
        from flashpar.infer.generate import first_token
        from flashpar.infer.sampling import Sampling

        first_token(self.model, self.ids, Sampling(), self.config["decode_steps"] + 1, self.strategy, self.cost)


def regions() -> dict:
    """The breakdown's named calls (``flashpar.bench.breakdown``): the planner, the cache's set-up, the last-token
    logits and the first choice (flashpar's and the torch peer's)."""
    from flashpar import cp
    from flashpar.bench.torch_prefill import first_logits
    from flashpar.infer.generate import set_up
    from flashpar.infer.prefill import last_logits
    from flashpar.infer.sampling import choose

    return {cp.plan: "planning", set_up: "setup", last_logits: "logits", choose: "logits", first_logits: "logits"}


def time_parts(runners: dict, names: list[str]) -> dict:
    """Each configuration's parts (``flashpar.bench.breakdown``) of one more time to first token, right after a
    plain run of it (``plain_ms``: its time to first token, which the parts are compared with): wall time by part,
    the stepping thread's CPU time by part (``cpu``) and the process's CPU time, every thread (``process_cpu_ms``:
    gloo's and the lanes' threads, and the kernel's work on the sends, besides the stepping thread's).  Not of
    torch_compile (``WHOLE_GRAPHS``): its blocks run as whole inductor graphs, which the breakdown's dispatch mode
    does not see, and under that mode dynamo runs no compiled frame; flashpar_compile's regions are timed whole as
    elementwise (``flashpar.bench.breakdown.timed_model``)."""
    import time

    import torch
    import torch.distributed as dist

    from flashpar.bench.breakdown import breakdown, timed_model

    with breakdown():  # the dispatch mode's first entry costs ~0.1 s once: not charged to the first configuration
        torch.ones(1).add(1)
    parts = {}
    for name in (n for n in names if n not in WHOLE_GRAPHS):  # whole compiled blocks: invisible to the mode
        dist.barrier()
        plain = runners[name].run()[0]
        dist.barrier()
        with breakdown(regions=regions()) as clock, timed_model(getattr(runners[name], "model", None), clock):
            c0 = time.process_time()
            clock.restart()  # the work alone: entering and leaving the block are not its
            runners[name].first_token()
            measured = clock.finish()
            process = time.process_time() - c0
        parts[name] = {**measured, "plain_ms": 1e3 * plain, "cpu": dict(clock.cpu_ms), "process_cpu_ms": 1e3 * process}
    return parts


def worker(config: dict) -> None:
    import torch
    import torch.distributed as dist

    from flashpar.bench.compile_time import compile_seconds, compiles
    from flashpar.dims import ParallelDims
    from flashpar.dist import as_timedelta
    from flashpar.models import Llama
    from flashpar.peak_memory import peak_memory, reset_peak_memory

    dist.init_process_group("gloo", timeout=as_timedelta(config["rank_timeout"]))
    torch.set_num_threads(config["threads"])
    tp, cpn = config["tp"], config["cp"]
    meshes = {"flashpar": ParallelDims(1, cpn, 1, tp).mesh("cpu")}
    if set(TORCH_PEERS) & set(config["configs"]):
        from flashpar.bench.torch_parallel import make_mesh

        meshes["torch"] = make_mesh(1, cpn, tp, "cpu")
    torch.manual_seed(config["seed"])
    full = Llama(model_config(config))
    ids = prompts(config)
    names = config["configs"]
    runners, compile_s, recompiles = {}, dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
    for name in names:  # torch.compile's time in each configuration's build and warm-up: its compile_s
        c0 = compile_seconds()
        runners[name] = Runner(name, config, ids, full, meshes)
        compile_s[name] += compile_seconds() - c0
    for name in names:
        c0 = compile_seconds()
        for _ in range(config["warmup"]):
            runners[name].run()
        compile_s[name] += compile_seconds() - c0
    samples = {name: [] for name in names}
    firsts = {}
    for rnd in range(config["rounds"]):
        for name in names[rnd % len(names):] + names[: rnd % len(names)]:
            dist.barrier()
            k0 = compiles()
            ttft, decode, kv, first = runners[name].run()
            recompiles[name] += compiles() - k0  # a compilation inside a timed run: 0 after the warm-up
            samples[name].append((ttft, decode, kv))
            firsts[name] = first
    parts = time_parts(runners, names)
    del runners
    mem = {}
    for name in names:
        dist.barrier()
        before = reset_peak_memory()
        runner = Runner(name, config, ids, full, meshes)
        runner.run()
        mem[name] = peak_memory(before)
        del runner
    worst = max(float((firsts[n] - firsts[names[0]]).abs().max() / firsts[names[0]].abs().max()) for n in names)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"samples": samples, "mem": mem, "worst": worst, "parts": parts,
                                      "compile_s": compile_s, "recompiles": recompiles})
    if dist.get_rank() == 0:
        with open(config["out"], "w") as f:
            json.dump(make_report(config, gathered, [len(p) for p in ids]), f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


PARTS = ("planning", "setup", "linear", "attention_fwd", "elementwise", "logits", "exposed_comm", "other")
"""The parts of a time to first token (``flashpar.bench.breakdown``'s, with the regions of ``regions()``):
planning (``cp.plan``), setup (the cache's schedule and buffers, the rows' index tensors, the tokens' shard),
the ops by kind, logits (the head, the sum over cp, the first choice), communication blocked on, and what no
op covers."""


def shown_parts(per_rank: list[dict]) -> tuple[str, ...]:
    """``PARTS`` and any other part a rank measured time in (none on these paths: then the parts still add up)."""
    others = [p for r in per_rank for p, v in r.items() if p not in PARTS and isinstance(v, float) and v > 0
              and not p.endswith("_ms")]
    return PARTS + tuple(dict.fromkeys(others))


def make_report(config: dict, gathered: list, lens: list[int]) -> dict:
    from flashpar.bench.train import breakdown_figures, compile_figures

    rows = []
    tokens = sum(lens)
    for name in config["configs"]:
        per_round = list(zip(*(g["samples"][name] for g in gathered), strict=True))  # [round][rank]
        ttft = statistics.median(max(s[0] for s in ranks) for ranks in per_round)
        decodes = [max(s[1] for s in ranks) for ranks in per_round if ranks[0][1] is not None]
        decode = statistics.median(decodes) if decodes else None
        rows.append({"name": name, "ttft_ms": 1e3 * ttft, "prefill_tokens_per_s": tokens / ttft,
                     "decode_tokens_per_s": len(lens) * config["decode_steps"] / decode if decode else None,
                     "kv_bytes": max(s[2] for s in per_round[0]),
                     "peak_mem_mb": max(g["mem"][name] for g in gathered), **compile_figures(gathered, name)})
        if name in gathered[0].get("parts", {}):
            per_rank = [g["parts"][name] for g in gathered]
            parts = shown_parts(per_rank)
            rows[-1].update(breakdown_figures(per_rank, parts, plain="ttft"))
            if "cpu" in per_rank[0]:
                rows[-1]["breakdown_cpu_ms"] = {p: sum(r["cpu"][p] for r in per_rank) / len(per_rank) for p in parts}
                rows[-1]["breakdown_process_cpu_ms"] = sum(r["process_cpu_ms"] for r in per_rank) / len(per_rank)
    worst = max(g["worst"] for g in gathered)
    setup = {k: config[k] for k in ("tp", "cp", "hidden", "layers", "heads", "kv_heads", "ffn", "tokens", "lengths",
                                    "scale", "decode_steps", "rounds", "warmup", "threads", "seed", "link_rate",
                                    "mode")}
    setup.update(world_size=config["tp"] * config["cp"], prompts=len(lens), prompt_lens=lens,
                 logits_rel_diff=worst, logits_agree=worst <= LOGITS_RTOL)
    return {"setup": setup, "configs": rows}


def format_report(report: dict) -> str:
    from flashpar.bench.train import format_recompiles

    s, rows = report["setup"], report["configs"]
    by = {r["name"]: r for r in rows}
    lines = [f"N={s['world_size']} (cp {s['cp']} x tp {s['tp']}), link {s['link_rate']}, Llama hidden {s['hidden']} x "
             f"{s['layers']} layers, heads {s['heads']}/{s['kv_heads']}, ffn {s['ffn']}; {s['prompts']} prompts, "
             f"{s['tokens']} tokens ({s['lengths']} / {s['scale']}), {s['decode_steps']} decode steps, fp32, "
             f"{s['threads']} thread(s)/rank; median of {s['rounds']} rounds (slowest rank)", "",
             f"{'config':<17}{'TTFT ms':>9}{'prefill tok/s':>15}{'decode tok/s':>14}{'KV MiB/rank':>13}"
             f"{'mem MB':>8}{'TTFT x base':>13}{'TTFT x torch':>14}{'compile s':>10}"]
    for r in rows:
        ratio = lambda base, r=r: f"{r['ttft_ms'] / by[base]['ttft_ms']:.2f}" if base in by else "-"  # noqa: E731
        decode = f"{r['decode_tokens_per_s']:>14.1f}" if r["decode_tokens_per_s"] else f"{'-':>14}"
        lines.append(f"{r['name']:<17}{r['ttft_ms']:>9.1f}{r['prefill_tokens_per_s']:>15.0f}{decode}"
                     f"{r['kv_bytes'] / 2**20:>13.2f}{r['peak_mem_mb']:>8.1f}{ratio('baseline'):>13}"
                     f"{ratio('torch'):>14}{r.get('compile_s', 0.0):>10.1f}")
    lines += format_breakdown(rows)
    lines += format_recompiles(rows)
    agree = "agree" if s["logits_agree"] else "DISAGREE"
    lines.append(f"first logits {agree}: largest relative difference {s['logits_rel_diff']:.2e} "
                 f"(tolerance {LOGITS_RTOL:g})")
    return "\n".join(lines)


def format_breakdown(rows: list[dict]) -> list[str]:
    """Each configuration's parts of one more time to first token (mean over the ranks), their sum, and the sum
    against the plain run's time to first token just before it (``sum/ttft``)."""
    rows = [r for r in rows if "breakdown_ms" in r]
    if not rows:
        return []
    parts = list(dict.fromkeys(p for r in rows for p in r["breakdown_ms"]))
    short = {"attention_fwd": "attention", "exposed_comm": "comm", "elementwise": "elemwise"}
    lines = ["", "where the time to first token goes (ms, mean over the ranks of one more run, timed by part: "
                 "flashpar.bench.breakdown)",
             f"{'config':<17}" + "".join(f"{short.get(p, p):>10}" for p in parts) + f"{'sum':>8}{'sum/ttft':>9}"]
    for r in rows:
        b = r["breakdown_ms"]
        total = sum(b.values())
        lines.append(f"{r['name']:<17}" + "".join(f"{b.get(p, 0.0):>10.1f}" for p in parts)
                     + f"{total:>8.0f}{total / r['breakdown_ttft_ms']:>9.2f}")
    cpu = [r for r in rows if "breakdown_cpu_ms" in r]
    if cpu:
        lines += ["", "the same run's CPU time by part (ms, the stepping thread, mean over the ranks; 'process': every "
                      "thread of the rank, the transport's included)",
                  f"{'config':<17}" + "".join(f"{short.get(p, p):>10}" for p in parts) + f"{'sum':>8}{'process':>9}"]
        for r in cpu:
            b = r["breakdown_cpu_ms"]
            lines.append(f"{r['name']:<17}" + "".join(f"{b.get(p, 0.0):>10.1f}" for p in parts)
                         + f"{sum(b.values()):>8.0f}{r['breakdown_process_cpu_ms']:>9.0f}")
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    from flashpar.bench.train import add_model_arguments
    from flashpar.cp.lengths import LENGTHS_HELP

    p.add_argument("--tp", type=int, default=2, help="(default 2)")
    p.add_argument("--cp", type=int, default=2, help="(default 2)")
    add_model_arguments(p)
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the packed batch (default 8192)")
    p.add_argument("--lengths", default="wlbllm", help=LENGTHS_HELP + ", or a comma list (default wlbllm)")
    p.add_argument("--scale", type=int, default=16, help="divide every length by this (default 16)")
    p.add_argument("--decode-steps", type=int, default=16, help="(default 16)")
    p.add_argument("--mode", default="auto", choices=("auto", "flash"), help="flashpar's TP overlap (default auto)")
    p.add_argument("--link-rate", default="2gbit", help="emulated per-rank link; 'none' = loopback (default 2gbit)")
    p.add_argument("--rounds", type=int, default=3, help="(default 3)")
    p.add_argument("--warmup", type=int, default=1, help="(default 1)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"subset of {','.join(CONFIGS)} (default {','.join(DEFAULT_CONFIGS)})")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report to this JSON file")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run")


def config_of(args: argparse.Namespace) -> dict:
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    return {"tp": args.tp, "cp": args.cp, "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
            "kv_heads": args.kv_heads, "ffn": args.ffn, "tokens": args.tokens, "lengths": args.lengths,
            "scale": args.scale, "decode_steps": args.decode_steps, "rounds": args.rounds, "warmup": args.warmup,
            "configs": configs, "threads": args.threads, "seed": args.seed, "rank_timeout": min(args.timeout, 600.0),
            "mode": args.mode}


def check_arguments(config: dict) -> str | None:
    """The first problem with the arguments, as one line, or ``None`` (before any rank starts)."""
    unknown = [c for c in config["configs"] if c not in CONFIGS]
    if unknown or not config["configs"] or len(set(config["configs"])) != len(config["configs"]):
        return f"--configs: expected distinct names from {','.join(CONFIGS)}, got {','.join(config['configs'])!r}"
    for key, least in (("tp", 1), ("cp", 1), ("hidden", 1), ("layers", 1), ("heads", 1), ("kv_heads", 1), ("ffn", 1),
                       ("tokens", 1), ("scale", 1), ("decode_steps", 1), ("rounds", 1), ("warmup", 0), ("threads", 1)):
        if config[key] < least:
            return f"--{key.replace('_', '-')} must be >= {least}, got {config[key]}"
    if config["tp"] * config["cp"] < 2:
        return "the mesh cp x tp must have at least 2 ranks"
    compiled = [c for c in config["configs"] if c in COMPILED]
    if compiled and config["warmup"] < 1:
        return (f"--warmup 0: {','.join(compiled)} compiles in its first run, which would be timed; "
                "give --warmup 1 or more")
    unit = 2 * config["cp"] * config["tp"]
    if config["tokens"] % unit:
        return f"--tokens {config['tokens']} must be a multiple of 2 x cp x tp = {unit} (torch's head-tail chunks)"
    try:
        cfg = model_config(config)
        for name in ("heads", "kv_heads", "ffn", "vocab_size"):
            if getattr(cfg, name) % config["tp"]:
                return f"--tp {config['tp']}: the model's {name} = {getattr(cfg, name)} is not divisible by it"
        prompt_lengths(config)
    except (OSError, ValueError) as err:
        return str(err).splitlines()[0]
    return None


def run(args: argparse.Namespace) -> int:
    from flashpar.bench.launch import run_workers, save_json
    from flashpar.bench.netlink import chosen_rate, rate_problem

    config = config_of(args)
    problem = check_arguments(config) or rate_problem(args.link_rate)
    if problem:
        print(f"flashpar bench prefill: {problem}", file=sys.stderr)
        return 2
    rate = chosen_rate(args.link_rate)
    report = run_workers("flashpar.bench.prefill", config["tp"] * config["cp"], config, rate, timeout=args.timeout)
    print(format_report(report), flush=True)
    save_json(args.json, report)
    if not report["setup"]["logits_agree"]:
        print("flashpar bench prefill: the first logits disagree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from flashpar.bench.launch import module_main

    module_main("flashpar bench prefill", add_arguments, run, worker)

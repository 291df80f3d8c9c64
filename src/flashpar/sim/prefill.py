"""``flashpar simulate prefill``: the time to first token of a packed prefill of Llama 3 70B / 405B on H100 nodes,
128K to 1M tokens, one prompt or a mixed pack, from the planner's own plans and cost model, beside Meta's
published context-parallel inference figures.

    flashpar simulate prefill [--models llama3-70b,llama3-405b] [--gpus 128] [--tokens 128K,1M]
                              [--hardware h100-ib] [--lengths wlbllm] [--json OUT]

Layout: a node of 8 GPUs is one tensor-parallel group (tp 8 over NVLink) and one cp rank; cp = GPUs / 8 over
InfiniBand, as Meta's runs (arXiv 2411.01783: Llama 3 405B, 16 nodes x 8 H100, CP 16 x TP 8).  A cp rank is
modelled as its 8 GPUs computing together (the cost model's device with 8 x the FLOP/s, and 8 x the link: each
GPU sends its own kv head's K/V over its own port), the forward alone (no ``per_step`` weighting):

    TTFT  = plan.figures().step          forward of every layer: max over cp ranks of
                                         max(linears + attention, K/V transfer + attention on remote K/V)
    K/V   = the bytes the plan moves, all cp ranks together
    tp    = 4 x layers x (T / cp) x hidden x 2 bytes x (tp - 1) / tp / NVLink   per GPU: the all-gathers and
                                         reduce-scatters of TP-SP, printed beside (FlashOverlap overlaps them with
                                         the GEMMs; the estimate assumes they hide)

Workloads: ``one`` (a single prompt of T tokens: every strategy cuts it over the cp ranks) and ``mixed`` (a pack
of T tokens from ``--lengths``).  ``per_doc`` is the head-tail, all-gathered-K/V layout of Meta's pass-KV ring;
``flashcp`` the planner's.  Published: 1M tokens in 77 s and 128K in 3.8 s (405B, 128 H100).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from flashpar.models import LlamaConfig

LLAMA3_405B = LlamaConfig(vocab_size=128256, hidden=16384, layers=126, heads=128, kv_heads=8, ffn=53248,
                          head_dim=128, rope_theta=500000.0, tie_embeddings=False, max_positions=131072)
"""Llama 3.1 405B's public architecture numbers (the model card's config)."""

PUBLISHED = {("llama3-405b", 128, 1 << 20): 77.0, ("llama3-405b", 128, 128 * 1024): 3.8}
"""Meta's context-parallel inference, time to first token in seconds (arXiv 2411.01783, H100 hosts)."""

GPUS_PER_NODE = 8
STRATEGIES = ("per_doc", "flashcp")


def model(name: str) -> LlamaConfig:
    if name == "llama3-405b":
        return LLAMA3_405B
    from flashpar.sim.model_configs import load_model

    return load_model(name)


def node_cost(cfg: LlamaConfig, hardware: str, tp: int):
    """The forward-only cost model of one cp rank: ``tp`` GPUs of ``hardware`` computing as one device."""
    from flashpar.cost import preset
    from flashpar.cp.cost import cost_model_of

    hw = preset(hardware)
    node = dataclasses.replace(hw, flops=hw.flops * tp, link_bytes_per_s=hw.link_bytes_per_s * tp)
    return cost_model_of(cfg, 2, node)


def tp_seconds(cfg: LlamaConfig, tokens_per_rank: int, tp: int) -> float:
    """The TP-SP collectives of one GPU over every layer (two all-gathers and two reduce-scatters a layer, bf16),
    on NVLink (``h100-nvlink``)."""
    from flashpar.cost import preset

    volume = 4 * cfg.layers * tokens_per_rank * cfg.hidden * 2 * (tp - 1) / tp
    return volume / preset("h100-nvlink").link_bytes_per_s


def rows_of(models: list[str], gpus: list[int], tokens: list[int], hardware: str, lengths: str, seed: int = 0):
    from flashpar import cp
    from flashpar.cp.lengths import resolve_lengths

    source = resolve_lengths(lengths)
    out = []
    for name in models:
        cfg = model(name)
        for n_gpus in gpus:
            cpn, tp = max(n_gpus // GPUS_PER_NODE, 1), min(n_gpus, GPUS_PER_NODE)
            cost = node_cost(cfg, hardware, tp)
            for t in tokens:
                packs = {"one": [t]}
                mixed = source.packs(t, 1, seed=seed)
                if mixed:
                    packs["mixed"] = mixed[0]
                for workload, lens in packs.items():
                    for strategy in STRATEGIES:
                        plan = cp.plan(lens, cpn, strategy=strategy, cost=cost)
                        fig = plan.figures()
                        out.append({"model": name, "gpus": n_gpus, "cp": cpn, "tp": tp, "tokens": t,
                                    "workload": workload, "prompts": len(lens), "strategy": strategy,
                                    "ttft_s": fig.step, "tp_comm_s": tp_seconds(cfg, max(fig.tokens), tp),
                                    "kv_recv_gb": sum(fig.recv_tokens) * cost.kv_bytes_per_token / 1e9,
                                    "published_s": PUBLISHED.get((name, n_gpus, t)) if workload == "one" else None})
    return out


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'model':<12}{'GPUs':>5}{'cp x tp':>8}{'tokens':>8}{'workload':>9}{'prompts':>8}{'strategy':>9}"
             f"{'TTFT s':>9}{'TP comm s':>10}{'K/V moved GB':>13}{'published s':>12}{'x published':>12}"]
    for r in rows:
        pub = r["published_s"]
        ratio = f"{r['ttft_s'] / pub:.2f}" if pub else "-"
        size = f"{r['tokens'] // 1024}K" if r["tokens"] < 1 << 20 else f"{r['tokens'] / (1 << 20):g}M"
        lines.append(f"{r['model']:<12}{r['gpus']:>5}{r['cp']:>4} x {r['tp']:<2}{size:>7}{r['workload']:>9}"
                     f"{r['prompts']:>8}{r['strategy']:>9}{r['ttft_s']:>9.2f}{r['tp_comm_s']:>10.2f}"
                     f"{r['kv_recv_gb']:>13.1f}{pub if pub else '-':>12}{ratio:>12}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="llama3-70b,llama3-405b", help="llama3-405b, shipped names or config.json paths")
    p.add_argument("--gpus", default="128", help="H100s, comma-separated (8 a node; default 128)")
    p.add_argument("--tokens", default="128K,1M", help="tokens of the prefill, comma-separated (default 128K,1M)")
    p.add_argument("--hardware", default="h100-ib", help="the GPU's preset, its link the inter-node one (default "
                                                        "h100-ib)")
    p.add_argument("--lengths", default="wlbllm", help="the mixed packs' lengths (default wlbllm)")
    p.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> int:
    from flashpar.sim.cp import parse_counts, parse_list, parse_size

    try:
        models = parse_list(args.models, "--models")
        for name in models:
            model(name)
        gpus = parse_counts(args.gpus, "--gpus")
        tokens = [parse_size(t) for t in parse_list(args.tokens, "--tokens")]
        rows = rows_of(models, gpus, tokens, args.hardware, args.lengths)
    except ValueError as err:
        print(f"flashpar simulate prefill: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            setup = {k: getattr(args, k) for k in ("models", "gpus", "tokens", "hardware", "lengths")}
            json.dump({"setup": setup, "rows": rows}, f, indent=1)
    return 0

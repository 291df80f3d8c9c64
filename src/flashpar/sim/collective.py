"""``flashpar simulate collective``: one collective as NCCL's tuner times it, split into latency and bandwidth.

    flashpar simulate collective --op all_gather --ranks 512 --nodes 64                   # a sweep of sizes
    flashpar simulate collective --op all_reduce --ranks 16 --nodes 2 --bytes 1M --all   # every algorithm

Per size: NCCL's pick (``flashpar.cost.nccl``: ring / tree / PAT x LL / LL128 / Simple, the fastest), its
``latency_s`` and ``bandwidth_s``, and for an all-gather or reduce-scatter flashpar's doubling collective over the
same ranks beside it (``ceil(log2 n)`` point-to-point steps on each rank's slowest link:
``flashpar.sim.zero.collective_s``), the alternative its ZeRO-3 units may take.  ``--bytes``: the whole buffer (an
all-gather's output, a reduce-scatter's input, an all-reduce's buffer, an all-to-all's send buffer), as
nccl-tests counts it.  The group's ranks are ``--nodes`` nodes of ``--ranks / --nodes`` each, on ``--hardware``'s
NVLink and ``--inter``'s port.  Every figure is NCCL's model, not a measurement.
"""

from __future__ import annotations

import argparse
import sys

from flashpar.sim.report import table, write_json

SIZES = "1K,64K,1M,16M,256M,1G"
COLUMNS = [("op", ""), ("bytes", ",d"), ("algorithm", ""), ("protocol", ""), ("latency_us", ",.1f"),
           ("bandwidth_us", ",.1f"), ("total_us", ",.1f"), ("doubling_us", ",.1f"), ("picked", "")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from flashpar.cost.nccl import OPS

    p.add_argument("--op", choices=OPS, required=True, help="the collective")
    p.add_argument("--ranks", type=int, required=True, help="ranks in the group")
    p.add_argument("--nodes", type=int, default=1, help="nodes the ranks are spread over, evenly (default 1)")
    p.add_argument("--bytes", default=SIZES, help=f"whole-buffer sizes, comma-separated, K/M/G suffixes "
                                                  f"(default {SIZES})")
    p.add_argument("--hardware", default="h100-nvlink", help="the GPU preset whose NVLink joins a node's ranks")
    p.add_argument("--inter", default="h100-ib", help="the preset whose port joins the nodes (default h100-ib)")
    p.add_argument("--all", action="store_true", help="every (algorithm, protocol) NCCL times, not only its pick")
    p.add_argument("--json", default=None, help="write {\"setup\": ..., \"rows\": [...]} to this file")


def _sizes(spec: str) -> list[int]:
    from flashpar.sim.cp import parse_list

    out = []
    for item in parse_list(spec, "--bytes"):
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(item[-1].upper(), 1)
        digits = item[:-1] if scale > 1 else item
        if not digits.isdigit() or int(digits) < 1:
            raise ValueError(f"--bytes: {item!r} is not a positive size")
        out.append(int(digits) * scale)
    return out


def rows(op: str, ranks: int, nodes: int, sizes: list[int], hardware: str, inter: str,
         every: bool = False) -> list[dict]:
    """One row per size (``every``: per candidate, the pick marked) of ``op`` on the group."""
    from flashpar.cost import group_hardware, nccl, preset
    from flashpar.sim.zero import DOUBLING, collective_s

    per_node = ranks // nodes
    hw = group_hardware(preset(hardware), preset(inter), range(ranks), per_node)
    out = []
    for b in sizes:
        pick = hw.collective(op, ranks, b)
        doubling = collective_s(DOUBLING, ranks, hw, b / ranks) if op in ("all_gather", "reduce_scatter") else None
        inside = hw.node_link_bytes_per_s or hw.link_bytes_per_s
        shown = nccl.candidates(op, ranks, hw.nodes, b, inside, hw.link_bytes_per_s) if every else [pick]
        for c in shown:
            out.append({"op": op, "ranks": ranks, "nodes": hw.nodes, "bytes": b, "algorithm": c.algorithm,
                        "protocol": c.protocol, "latency_s": c.latency_s, "bandwidth_s": c.bandwidth_s,
                        "latency_us": 1e6 * c.latency_s, "bandwidth_us": 1e6 * c.bandwidth_s,
                        "total_us": 1e6 * c.total_s, "doubling_us": None if doubling is None else 1e6 * doubling,
                        "picked": "yes" if c == pick else ""})
    return out


def run(args: argparse.Namespace) -> int:
    try:
        if args.ranks < 1:
            raise ValueError(f"--ranks must be >= 1, got {args.ranks}")
        if args.nodes < 1 or args.ranks % args.nodes:
            raise ValueError(f"--nodes {args.nodes} must be >= 1 and divide --ranks {args.ranks}")
        from flashpar.cost import preset

        preset(args.hardware), preset(args.inter)
        out = rows(args.op, args.ranks, args.nodes, _sizes(args.bytes), args.hardware, args.inter, args.all)
    except ValueError as err:
        print(f"flashpar simulate collective: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    from flashpar.cost.nccl import VERSION

    print(table(out, COLUMNS, title=f"NCCL {'.'.join(map(str, VERSION))}'s model (src/graph/tuning.cc), simulated: "
                                    f"{args.op} over {args.ranks} ranks on {args.nodes} node(s) ({args.hardware} "
                                    f"NVLink, {args.inter} port); doubling: flashpar's point-to-point steps"))
    write_json(args.json, {"op": args.op, "ranks": args.ranks, "nodes": args.nodes, "hardware": args.hardware,
                           "inter": args.inter, "nccl": ".".join(map(str, VERSION)), "simulated": True}, out)
    return 0

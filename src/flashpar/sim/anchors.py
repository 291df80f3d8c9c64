"""Published torchtitan runs on H100s, simulated with the same settings: the ``h100-96gb`` preset's one fitted
figure (``fit``) and the checks of the rest (``flashpar simulate anchors``).

Sources (pytorch/torchtitan at b5bcd76, read with git; the run settings the files leave out are the train
config of the torchtitan commit each file names):

* ``benchmarks/llama3_h100_202412_torchtitan.md`` (torchtitan 9dec370): hardware lines 11-15 (Grand Teton,
  8 H100 per host on NVLink, 96 GB HBM2e at 2.4 TB/s, 400 Gb/s RDMA per GPU, 500 W); Table 1 line 23
  (Llama 3.1 8B, 8 GPUs, FSDP, local batch 2, selective activation checkpointing) with line 27 (FSDP, 5,762
  tokens/s/GPU) and line 28 (+ torch.compile, 6,667); Table 3 line 40 (the same on 128 GPUs) with lines 44
  (5,605) and 45 (6,514).  ``train_configs/llama3_8b.toml`` at 9dec370: seq_len 8192 (line 30), selective
  option 'op' (lines 54-55), compile false (line 37).
* ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md`` (torchtitan 820504e): the same hardware; line 20
  (Llama 3 70B, 256 H100s, FSDP 32, TP 8, torch.compile, full AC, local batch 16) with line 24 (bf16: 597.3
  tokens/s/GPU vanilla TP, 652.4 async TP); line 28 (Llama 3 8B, 64 H100s, FSDP 8, TP 8, torch.compile,
  per-op SAC, local batch 12) with line 32 (bf16: 4,378 and 4,809.4).
  ``torchtitan/models/llama3/train_configs/llama3_70b.toml`` / ``llama3_8b.toml`` at 820504e: seq_len 8192
  (line 34).

What every run did, and how it is simulated (``Workload``): bf16 compute with fp32 gradient reduce-scatters
(torchtitan's mixed_precision_param / _reduce defaults); plain causal attention over each 8,192-token sequence
(SDPA ``is_causal``, no document mask: one document per sequence); FSDP2 units as both commits wrap them, the
blocks one each (the last one not resharded after forward) and the root module's embedding, final norm and
head as one unit kept gathered to the end of backward (``fsdp_root``); the vocabulary-parallel head and loss
under tp; gradient clipping (``max_norm``) and AdamW.  Selective checkpointing is torchtitan's per-op policy
(``flashpar.sim.step.selective_recompute``), full checkpointing the whole block.  Without torch.compile the
model's elementwise ops run unfused (``Workload.eager``).  The inter-host link is h100-ib's (400 Gb/s per
GPU, as the files state); 8 GPUs per host.

The fit (``fit``): one free scalar, the clock factor ``c`` of ``h100-96gb`` (``gemm_eff = 0.7 c``,
``attn_peak = 0.6 c``; launch overhead 8 us and link latency 10 / 15 us fixed), found by bisection so that
the torch configuration reproduces Table 1's FSDP run (``role == "fit"``).  Every other run is a check.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flashpar.sim.topology import Layout

TITAN = "pytorch/torchtitan benchmarks/"


@dataclass(frozen=True)
class Anchor:
    name: str
    source: str  # file and line of the published figure
    model: str
    layout: Layout
    batch: int  # local batch size (sequences per dp rank)
    config: str  # the simulator's configuration (flashpar.sim.peers)
    recompute: str  # "selective" (torchtitan's per-op SAC) or "full"
    compiled: bool
    published: float  # tokens/s per GPU
    role: str  # "fit" or "check"
    memory_gib: float | None = None  # the published peak memory, where given
    seq: int = 8192


DEC_2024 = TITAN + "llama3_h100_202412_torchtitan.md"
JUN_2025 = TITAN + "asyncTP_llama3_h100_2025-06_torchtitan.md"

ANCHORS = (
    Anchor("8b-fsdp-8", f"{DEC_2024}:27 (Table 1)", "llama3-8b", Layout(8, 1, 1, 1), 2, "torch", "selective",
           False, 5762.0, "fit", 82.4),
    Anchor("8b-fsdp-128", f"{DEC_2024}:44 (Table 3)", "llama3-8b", Layout(128, 1, 1, 1), 2, "torch", "selective",
           False, 5605.0, "check", 67.0),
    Anchor("70b-tp", f"{JUN_2025}:24", "llama3-70b", Layout(32, 1, 1, 8), 16, "torch", "full", True, 597.3, "check"),
    Anchor("70b-async-tp", f"{JUN_2025}:24", "llama3-70b", Layout(32, 1, 1, 8), 16, "torch_async_tp", "full", True,
           652.4, "check"),
    Anchor("8b-fsdp-8-compile", f"{DEC_2024}:28 (Table 1)", "llama3-8b", Layout(8, 1, 1, 1), 2, "torch",
           "selective", True, 6667.0, "check", 77.0),
    Anchor("8b-fsdp-128-compile", f"{DEC_2024}:45 (Table 3)", "llama3-8b", Layout(128, 1, 1, 1), 2, "torch",
           "selective", True, 6514.0, "check", 62.0),
    Anchor("8b-tp", f"{JUN_2025}:32", "llama3-8b", Layout(8, 1, 1, 8), 12, "torch", "selective", True, 4378.0,
           "check"),
    Anchor("8b-async-tp", f"{JUN_2025}:32", "llama3-8b", Layout(8, 1, 1, 8), 12, "torch_async_tp", "selective",
           True, 4809.4, "check"),
)
TOLERANCE = {"fit": 0.02, "check": 0.15}


def workload(a: Anchor, clock: float | None = None):
    """The run of ``a`` as a :class:`flashpar.sim.workload.Workload` on ``h100-96gb`` (at ``clock``; None:
    the preset's own)."""
    from flashpar.cost import preset
    from flashpar.cost.presets import h100_96gb
    from flashpar.sim.model_configs import load_model
    from flashpar.sim.topology import Cluster
    from flashpar.sim.workload import Workload

    device = preset("h100-96gb") if clock is None else h100_96gb(clock)
    cluster = Cluster(device, preset("h100-ib"), 8, "h100-96gb", "h100-ib")
    return Workload(load_model(a.model), a.layout, cluster, ((a.seq,),), batch=a.batch,
                    checkpoint=a.recompute == "full", selective=a.recompute == "selective", eager=not a.compiled,
                    fsdp_root=True)


def simulate(a: Anchor, clock: float | None = None) -> dict:
    """``flashpar.sim.predict.simulate`` of the run, with ``tokens_per_s_per_gpu``."""
    from flashpar.sim.peers import PEERS
    from flashpar.sim.predict import simulate as run

    r = run(workload(a, clock), PEERS[a.config])
    r["tokens_per_s_per_gpu"] = r["tokens_per_s"] / a.layout.gpus
    return r


def fit(lo: float = 0.2, hi: float = 1.4, rel: float = 1e-4) -> float:
    """The clock factor at which the fit run's simulated tokens/s/GPU is its published figure (bisection:
    tokens/s grows with the clock)."""
    anchor = next(a for a in ANCHORS if a.role == "fit")

    def gap(c: float) -> float:
        return simulate(anchor, c)["tokens_per_s_per_gpu"] - anchor.published

    if gap(lo) > 0 or gap(hi) < 0:
        raise ValueError(f"the fit run's published {anchor.published} tokens/s/GPU is outside clock [{lo}, {hi}]")
    while hi - lo > rel * lo:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def rows(clock: float | None = None) -> list[dict]:
    """One row per anchor: published and simulated tokens/s/GPU, the error, whether it is within its role's
    tolerance, the simulated exposed share and memory beside the published memory."""
    out = []
    for a in ANCHORS:
        r = simulate(a, clock)
        err = r["tokens_per_s_per_gpu"] / a.published - 1
        out.append({"anchor": a.name, "role": a.role, "config": a.config, "model": a.model, "layout": a.layout.label(),
                    "batch": a.batch, "recompute": a.recompute, "compile": "yes" if a.compiled else "no",
                    "published": a.published, "simulated": r["tokens_per_s_per_gpu"], "error": err,
                    "within": "yes" if abs(err) <= TOLERANCE[a.role] else "no", "mfu": r["mfu"],
                    "exposed": sum(r["exposed"].values()) / r["step_s"], "mem_gib": r["memory"]["total"] * 1e9 / 2**30,
                    "published_mem_gib": a.memory_gib, "source": a.source, **dataclasses.asdict(a.layout)})
    return out


# ----------------------------------------------------------------------------------------------
# command line

COLUMNS = [("anchor", ""), ("role", ""), ("config", ""), ("layout", ""), ("batch", "d"), ("recompute", ""),
           ("compile", ""), ("published", ",.1f"), ("simulated", ",.1f"), ("error", "+.1%"), ("within", ""),
           ("mfu", ".1%"), ("exposed", ".1%"), ("mem_gib", ".1f"), ("published_mem_gib", ".1f")]


def add_arguments(p) -> None:
    p.add_argument("--fit", action="store_true",
                   help="run the fit again and show the anchors at the fitted clock (the preset's otherwise)")
    p.add_argument("--json", default=None, help="write {\"setup\": ..., \"rows\": [...]} to this file")


def run(args) -> int:
    from flashpar.cost.presets import H100_96GB_CLOCK
    from flashpar.sim.report import table, write_json

    clock = fit() if args.fit else H100_96GB_CLOCK
    out = rows(clock)
    how = "fitted by this run" if args.fit else "the preset's"
    print(table(out, COLUMNS, title=f"simulated, h100-96gb preset (clock factor {clock:.4f}, {how}: gemm_eff "
                                    f"{0.7 * clock:.3f}, attn_peak {0.6 * clock:.3f}), h100-ib between hosts of 8; "
                                    f"tokens/s per GPU, published (torchtitan) against simulated; within: "
                                    f"{TOLERANCE['fit']:.0%} for the fit, {TOLERANCE['check']:.0%} for a check"))
    for r in out:
        print(f"  {r['anchor']}: {r['source']}")
    write_json(args.json, {"hardware": "h100-96gb", "clock": clock, "fitted": bool(args.fit), "simulated": True},
               out)
    return 0

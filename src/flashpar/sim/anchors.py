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
model's elementwise ops run unfused (``Workload.torch_compiled`` False: ``flashpar.sim.elementwise``).  The
inter-host link is h100-ib's (400 Gb/s per GPU, as the files state); 8 GPUs per host.

The fit (``fit``): two free scalars of ``h100-96gb``.  The clock factor ``c`` (``gemm_eff = 0.7 c``,
``attn_peak = 0.6 c``; launch overhead, NCCL's latencies and link rates fixed) makes the torch configuration
reproduce Table 1's FSDP run; the step spread ``s`` (``flashpar.sim.sync``: a synchronous step waits for the
slowest of its GPUs) makes it lose what Table 3's 128-GPU run of the same configuration loses (2.7%).  Both are
``role == "fit"``.  Every other run is a check, memory where published too, and the torch.compile pair of
Tables 1 and 3 checks the scaling loss (``scaling_losses``).
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
           False, 5605.0, "fit", 67.0),
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
BY_NAME = {a.name: a for a in ANCHORS}
FIT_CLOCK, FIT_SPREAD = "8b-fsdp-8", "8b-fsdp-128"
"""The runs the two fitted figures reproduce: the clock factor's, and the spread's (the same configuration on 16x
the GPUs)."""
SCALING = (("8b-fsdp-8", "8b-fsdp-128"), ("8b-fsdp-8-compile", "8b-fsdp-128-compile"))
"""Configurations published on 8 and on 128 GPUs: the fitted pair, and the pair that checks the scaling loss."""


def workload(a: Anchor, clock: float | None = None, spread: float | None = None):
    """The run of ``a`` as a :class:`flashpar.sim.workload.Workload` on ``h100-96gb`` (at ``clock`` and ``spread``;
    None: the preset's own)."""
    from flashpar.cost import preset
    from flashpar.cost.presets import H100_96GB_SPREAD, h100_96gb
    from flashpar.sim.model_configs import load_model
    from flashpar.sim.topology import Cluster
    from flashpar.sim.workload import Workload

    device = preset("h100-96gb") if clock is None else h100_96gb(clock)
    cluster = Cluster(device, preset("h100-ib"), 8, "h100-96gb", "h100-ib",
                      H100_96GB_SPREAD if spread is None else spread)
    return Workload(load_model(a.model), a.layout, cluster, ((a.seq,),), batch=a.batch,
                    checkpoint_activations=a.recompute == "full", selective=a.recompute == "selective",
                    torch_compiled=a.compiled, flashpar_compiled=a.compiled,
                    fsdp_root=True)


def simulate(a: Anchor, clock: float | None = None, spread: float | None = None) -> dict:
    """``flashpar.sim.predict.simulate`` of the run, with ``tokens_per_s_per_gpu``."""
    from flashpar.sim.peers import PEERS
    from flashpar.sim.predict import simulate as run

    r = run(workload(a, clock, spread), PEERS[a.config])
    r["tokens_per_s_per_gpu"] = r["tokens_per_s"] / a.layout.gpus
    return r


def fit_clock(spread: float, lo: float = 0.2, hi: float = 1.4, rel: float = 1e-4) -> float:
    """The clock factor at which the clock run's (``FIT_CLOCK``) simulated tokens/s/GPU is its published figure,
    at ``spread`` (bisection: tokens/s grows with the clock)."""
    anchor = BY_NAME[FIT_CLOCK]

    def gap(c: float) -> float:
        return simulate(anchor, c, spread)["tokens_per_s_per_gpu"] - anchor.published

    if gap(lo) > 0 or gap(hi) < 0:
        raise ValueError(f"the fit run's published {anchor.published} tokens/s/GPU is outside clock [{lo}, {hi}]")
    while hi - lo > rel * lo:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def fit(rounds: int = 4) -> tuple[float, float]:
    """(clock, spread): the clock reproduces ``FIT_CLOCK``'s tokens/s, the spread the ratio of ``FIT_SPREAD``'s to
    it (the same configuration on more GPUs: ``flashpar.sim.sync``).  The two are nearly independent, so a few
    rounds of: the clock at the spread, then the spread that closes the ratio at that clock, in closed form from
    ``(1 + s z(n)) / (1 + s z(N)) x base ratio = published ratio``."""
    from flashpar.sim.sync import expected_max

    small, large = BY_NAME[FIT_CLOCK], BY_NAME[FIT_SPREAD]
    spread = 0.0
    for _ in range(rounds):
        clock = fit_clock(spread)
        base = (simulate(large, clock, 0.0)["tokens_per_s_per_gpu"]
                / simulate(small, clock, 0.0)["tokens_per_s_per_gpu"])
        q = large.published / small.published / base
        z_small, z_large = expected_max(small.layout.gpus), expected_max(large.layout.gpus)
        spread = max((q - 1) / (z_small - q * z_large), 0.0)
    return fit_clock(spread), spread


def rows(clock: float | None = None, spread: float | None = None) -> list[dict]:
    """One row per anchor: published and simulated tokens/s/GPU, the error, whether it is within its role's
    tolerance, the simulated exposed share, memory beside the published memory and its error."""
    out = []
    for a in ANCHORS:
        r = simulate(a, clock, spread)
        err = r["tokens_per_s_per_gpu"] / a.published - 1
        mem = r["memory"]["total"] * 1e9 / 2**30
        mem_err = mem / a.memory_gib - 1 if a.memory_gib else None
        within = abs(err) <= TOLERANCE[a.role] and (mem_err is None or abs(mem_err) <= TOLERANCE["check"])
        out.append({"anchor": a.name, "role": a.role, "config": a.config, "model": a.model, "layout": a.layout.label(),
                    "batch": a.batch, "recompute": a.recompute, "compile": "yes" if a.compiled else "no",
                    "published": a.published, "simulated": r["tokens_per_s_per_gpu"], "error": err,
                    "within": "yes" if within else "no", "mfu": r["mfu"],
                    "exposed": sum(r["exposed"].values()) / r["step_s"], "sync": r["sync_s"] / r["step_s"],
                    "mem_gib": mem, "published_mem_gib": a.memory_gib, "mem_error": mem_err, "source": a.source,
                    **dataclasses.asdict(a.layout)})
    return out


def scaling_losses(rows_: list[dict]) -> list[dict]:
    """Per configuration published on 8 and 128 GPUs (``SCALING``): the tokens/s/GPU lost from the one to the
    other, published and simulated."""
    by = {r["anchor"]: r for r in rows_}
    out = []
    for small, large in SCALING:
        pub = 1 - by[large]["published"] / by[small]["published"]
        sim = 1 - by[large]["simulated"] / by[small]["simulated"]
        out.append({"from": small, "to": large, "published_loss": pub, "simulated_loss": sim,
                    "role": "fit" if (small, large) == (FIT_CLOCK, FIT_SPREAD) else "check"})
    return out


# ----------------------------------------------------------------------------------------------
# command line

COLUMNS = [("anchor", ""), ("role", ""), ("config", ""), ("layout", ""), ("batch", "d"), ("recompute", ""),
           ("compile", ""), ("published", ",.1f"), ("simulated", ",.1f"), ("error", "+.1%"), ("within", ""),
           ("mfu", ".1%"), ("exposed", ".1%"), ("sync", ".1%"), ("mem_gib", ".1f"), ("published_mem_gib", ".1f"),
           ("mem_error", "+.1%")]
LOSS_COLUMNS = [("from", ""), ("to", ""), ("role", ""), ("published_loss", ".1%"), ("simulated_loss", ".1%")]


def add_arguments(p) -> None:
    p.add_argument("--fit", action="store_true",
                   help="run the fit again and show the anchors at the fitted clock and spread (the preset's "
                        "otherwise)")
    p.add_argument("--json", default=None, help="write {\"setup\": ..., \"rows\": [...]} to this file")


def run(args) -> int:
    from flashpar.cost.presets import H100_96GB_CLOCK, H100_96GB_SPREAD
    from flashpar.sim.report import table, write_json

    clock, spread = fit() if args.fit else (H100_96GB_CLOCK, H100_96GB_SPREAD)
    out = rows(clock, spread)
    losses = scaling_losses(out)
    how = "fitted by this run" if args.fit else "the preset's"
    print(table(out, COLUMNS, title=f"simulated, h100-96gb preset (clock factor {clock:.4f} and step spread "
                                    f"{spread:.4f}, {how}: gemm_eff {0.7 * clock:.3f}, attn_peak {0.6 * clock:.3f}), "
                                    f"h100-ib between hosts of 8; tokens/s per GPU and memory, published (torchtitan) "
                                    f"against simulated; within: {TOLERANCE['fit']:.0%} for a fit, "
                                    f"{TOLERANCE['check']:.0%} for a check (tokens/s and memory)"))
    print()
    print(table(losses, LOSS_COLUMNS, title="tokens/s/GPU lost from 8 to 128 GPUs"))
    for r in out:
        print(f"  {r['anchor']}: {r['source']}")
    write_json(args.json, {"hardware": "h100-96gb", "clock": clock, "spread": spread, "fitted": bool(args.fit),
                           "scaling": losses, "simulated": True}, out)
    return 0

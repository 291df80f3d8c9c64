"""``ParallelOptions``: how a model runs on its mesh, one typed value for the trainer, the check, inference, the
benchmarks and the simulator.

Every setting has one name, the ``flashpar train`` flag's (``TrainConfig`` inherits these fields, so each is a
flag with the help written here, in the ``--help`` group its ``group`` names)::

    mode                    the tensor-parallel / Ulysses linears' overlap mode (flash, ring, slice, none, auto)
    dp_mode                 zero3 (every weight's rows split over the shard group) or replicate
    dtype                   fp32 or bf16 compute (fp32 master weights either way)
    checkpoint_activations  each block recomputed in backward
    compile                 each block's elementwise regions compiled by torch.compile (flashpar.models.regions)
    regather                a column-parallel linear gathers its input again in backward (else keeps it)
    gather_vocab            tp ranks gather a vocabulary table smaller than their tokens (else move activations)
    attention_backend       the context-parallel attention's kernels (auto: the device's default)
    zero_schedule           ZeRO-3 per block: prefetch, fused, one per block, or auto
    prefetch                ZeRO-3 units gathered ahead of the one computing
    zero_collective         how ZeRO-3's units travel: ring (the backend's), doubling, or auto
    timeout                 seconds any distributed wait may take

``auto`` for ``zero_schedule`` / ``zero_collective`` (``flashpar train``'s defaults; the library's are prefetch and
ring) is a choice made once, at set-up, from one read of the device figures
(``flashpar.train.planning.resolve_options``): the options the model is built with hold the choice, not ``auto``.
``mode="auto"`` stays ``auto``: it is picked per op and shape as the ops run (``flashpar.overlap.call.pick_mode``).
Validation is here, once, each problem one line (``ValueError``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from flashpar.timeout import DEFAULT_TIMEOUT_S

MODES = ("flash", "ring", "slice", "none", "auto")
DP_MODES = ("zero3", "replicate")
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
"""The compute dtypes by name, with their element size (``flashpar.models.precision.DTYPES``: the torch dtypes)."""
ZERO_SCHEDULES = ("auto", "prefetch", "fused")
ZERO_COLLECTIVES = ("auto", "ring", "doubling")

MESH = "mesh and parallelism"
MEMORY = "precision, memory and compilation"
FAULTS = "faults"


def _opt(default, doc: str, group: str, *, flag: bool = True, **cli):
    """A field with its documentation (the flag's help), its ``--help`` group and flag settings (``choices``);
    ``flag=False``: not a ``flashpar train`` flag (the library's setting only)."""
    return field(default=default, metadata={"doc": doc, "group": group if flag else None, **cli})


@dataclass(frozen=True, kw_only=True)
class ParallelOptions:
    """How a model runs on its mesh (the module docstring)."""

    mode: str = _opt("flash", "TP overlap mode", MESH, choices=MODES)
    dp_mode: str = _opt("zero3", "data parallelism: ZeRO-3 (every weight's rows split over the dp x cp x ulysses "
                                 "ranks that hold its tp shard, with their gradients and AdamW state), or whole "
                                 "copies", MESH, choices=DP_MODES)
    zero_schedule: str | tuple[str, ...] = _opt(
        "prefetch", "ZeRO-3 per block: prefetch (a block's weights gathered --prefetch blocks ahead while earlier ones "
                "compute, its GEMMs undivided), fused (the gather fused with the block's GEMMs, one piece per peer), "
                "or auto (the cost model's choice per block: every block prefetched, block 0 fused, or every block "
                "fused, the fastest where it beats prefetching every block by more than 2 percent)", MESH,
        choices=ZERO_SCHEDULES)
    prefetch: int = _opt(1, "ZeRO-3 blocks gathered ahead of the one computing (--mode none: 0, blocking)", MESH)
    zero_collective: str = _opt("ring", "how ZeRO-3's prefetched units travel: ring (the backend's all-gather and "
                                        "reduce-scatter: NCCL's algorithms, gloo's ring), doubling (the same bytes "
                                        "in ceil(log2 n) point-to-point steps), or auto (the cost model's choice: "
                                        "doubling where it is predicted more than 2 percent faster; --mode none: "
                                        "ring)", MESH, choices=ZERO_COLLECTIVES)
    dtype: str = _opt("fp32", "compute dtype: bf16 computes and communicates activations and weights in bf16 with "
                              "fp32 master weights, AdamW state and gradient sums", MEMORY, choices=tuple(DTYPE_BYTES))
    checkpoint_activations: bool = _opt(False, "recompute each block's activations in backward (less memory, one "
                                               "more forward per block)", MEMORY)
    compile: bool = _opt(False, "compile each block's elementwise work (norms, rope, SwiGLU, residual adds) with "
                                "torch.compile, one compiled region per piece between the communicating ops, "
                                "which stay eager (their overlap unchanged); compiled once at start-up",
                         MEMORY)
    regather: bool = _opt(False, "gather each column-parallel linear's input (q/k/v, gate/up, head) again in backward, "
                                 "as Megatron does, instead of keeping the gathered input as torch's DTensor linear "
                                 "does: (tp - 1) / tp less activation memory per such linear, one more all-gather "
                                 "each per step", MEMORY)
    gather_vocab: bool = _opt(True, "where the vocabulary is smaller than a cp rank's tokens, the tp ranks gather "
                                    "the embedding and head weights instead of moving the activations", MEMORY,
                              flag=False)
    attention_backend: str = _opt("auto", "the context-parallel attention's kernels: auto (the device's default, "
                                          "flashpar.cp.kernels.default_backend), flash, math or varlen", MEMORY,
                                  flag=False, choices=("auto", "flash", "math", "varlen"))
    timeout: float = _opt(DEFAULT_TIMEOUT_S, "seconds any distributed wait may take", FAULTS)

    def __post_init__(self) -> None:
        for name, f in OPTION_FIELDS.items():  # every field by its kind: a new one is checked with no edit here
            value, choices = getattr(self, name), f.metadata.get("choices")
            if isinstance(f.default, bool) and not isinstance(value, bool):
                raise ValueError(f"{flag(name)} must be True or False, got {value!r}")
            if choices and name != "zero_schedule" and value not in choices:
                raise ValueError(f"{flag(name)} must be one of {', '.join(choices)}, got {value!r}")
        schedule = self.zero_schedule
        if isinstance(schedule, list):
            object.__setattr__(self, "zero_schedule", schedule := tuple(schedule))
        if isinstance(schedule, str) and schedule not in ZERO_SCHEDULES or isinstance(schedule, tuple) and (
                not schedule or any(s not in ZERO_SCHEDULES[1:] for s in schedule)) or not isinstance(
                schedule, str | tuple):
            raise ValueError(f"zero-schedule must be one of {', '.join(ZERO_SCHEDULES)} or one of "
                             f"{', '.join(ZERO_SCHEDULES[1:])} per block, got {schedule!r}")
        if not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool) or self.prefetch < 0:
            raise ValueError(f"prefetch must be an integer >= 0, got {self.prefetch!r}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, int | float) or not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one element of the compute dtype."""
        return DTYPE_BYTES[self.dtype]

    @property
    def save_gathered(self) -> bool:
        """Whether a column-parallel linear keeps its gathered input for backward (``not regather``)."""
        return not self.regather

    @property
    def resolved(self) -> bool:
        """Whether no set-up choice is left (``zero_schedule`` / ``zero_collective`` not ``auto``)."""
        return self.zero_schedule != "auto" and self.zero_collective != "auto"

    def replace(self, **changes) -> ParallelOptions:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The options as JSON values (a checkpoint's, a report's)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(ParallelOptions)}
        if isinstance(out["zero_schedule"], tuple):
            out["zero_schedule"] = list(out["zero_schedule"])
        return out

    def describe(self) -> str:
        """One line: every setting by its flag's name, the resolved choices included (a per-block schedule as its
        blocks' choices, or one where every block has the same)."""
        words = []
        for name in OPTION_FIELDS:
            value = getattr(self, name)
            if isinstance(value, tuple):
                value = value[0] if len(set(value)) == 1 else ",".join(value)
            elif isinstance(value, bool):
                value = "on" if value else "off"
            words.append(f"{flag(name)} {value:g}" if isinstance(value, float) else f"{flag(name)} {value}")
        return ", ".join(words)


OPTION_FIELDS = {f.name: f for f in dataclasses.fields(ParallelOptions)}


def flag(name: str) -> str:
    """The ``flashpar train`` flag of a field (dashes for underscores, without the leading ``--``)."""
    return name.replace("_", "-")


def of(source) -> ParallelOptions:
    """The options held by ``source`` (any object with every field of ``ParallelOptions``: a ``TrainConfig``)."""
    return ParallelOptions(**{name: getattr(source, name) for name in OPTION_FIELDS})

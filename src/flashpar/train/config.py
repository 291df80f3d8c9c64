"""``TrainConfig``: every setting of a training run, typed, documented and validated in one place.

``flashpar train``'s flags are made from these fields (``add_arguments``: the flag is the field name
with dashes, its default and help are the field's) and ``from_args`` builds the config back from the
parsed flags; the model sizes are ``LlamaConfig``'s (``--hidden`` ... ``--ffn``, or ``--hf-config``, or the
folder of ``--init-from``: then size flags that disagree with it are refused).

Validation happens twice, each in one place, each error one line (``ValueError``):
``TrainConfig.__post_init__`` checks the values themselves (choices, ranges, the mesh against the model
sizes and the sequence length); ``ready(config, world_size)`` checks the run's surroundings before
any process group starts (the number of processes, the output folder, the corpus, the checkpoint to
resume, matplotlib for ``--plot``, CUDA for ``--device cuda``, the weights of ``--init-from``; then the
tokenizer, the ``--data`` files and the held-out documents, building the token cache:
``flashpar.train.data.ready_data``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from flashpar.cp import STRATEGIES
from flashpar.dims import ParallelDims
from flashpar.models import LlamaConfig
from flashpar.options import FAULTS, MEMORY, MESH, OPTION_FIELDS, ParallelOptions
from flashpar.options import of as options_of
from flashpar.ranks import local_world_size
from flashpar.train.resume_settings import AUTO, auto_folder

DEVICES = ("cpu", "cuda")
MODEL_FLAGS = ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn")  # LlamaConfig fields that are flags


def _opt(default, doc: str, **cli):
    """A field with its documentation (the flag's help) and flag settings (``choices``, ``type``)."""
    return field(default=default, metadata={"doc": doc, **cli})


def _trainer_default(name: str, default):
    """The field ``name`` of ``ParallelOptions`` with the trainer's own default (its documentation kept)."""
    return field(default=default, metadata=OPTION_FIELDS[name].metadata)


@dataclass(frozen=True, kw_only=True)
class TrainConfig(ParallelOptions):
    """One training run (or ``--check``) on a ``dp x cp x ulysses x tp`` mesh; see ``flashpar.train.run``.  How the
    model runs on the mesh (overlap mode, ZeRO-3, dtype, checkpointing ...) is ``ParallelOptions``' fields, which it
    inherits: each a flag in the ``--help`` group the field names (``options()``: them alone)."""

    # -- the model --
    model: LlamaConfig = field(default_factory=LlamaConfig,
                               metadata={"doc": "the model's sizes (flags --hidden ... --ffn, or --hf-config)"})
    init_from: str | None = _opt(None, "start from the weights of a Hugging Face Llama folder (config.json and "
                                       "model.safetensors or its index): the model sizes are the folder's, each rank "
                                       "reads only its slices; with --resume the checkpoint's weights win", type=str)
    seed: int = _opt(0, "seed of the weights and of the corpus order")

    # -- mesh and parallelism --
    nproc: int | None = _opt(None, "processes to spawn without torchrun (default: the mesh's dp x cp x ulysses x "
                                   "tp)", type=int)
    dp: int = _opt(1, "data-parallel size of the mesh")
    cp: int = _opt(2, "context-parallel size of the mesh")
    ulysses: int = _opt(1, "Ulysses size of the mesh: heads split over U ranks by all-to-alls fused with the QKV and "
                           "output projections, inside each cp rank; needs --tp 1 (both split the heads)")
    tp: int = _opt(2, "tensor-parallel size of the mesh (1 with --ulysses > 1)")
    strategy: str = _opt("flashcp", "context-parallel plan", choices=STRATEGIES)
    zero_schedule: str | tuple[str, ...] = _trainer_default("zero_schedule", "auto")  # chosen at set-up
    zero_collective: str = _trainer_default("zero_collective", "auto")
    device: str = _opt("cpu", "cpu (gloo) or cuda (NCCL, one GPU per rank)", choices=DEVICES)
    threads: int = _opt(1, "torch threads per CPU rank")
    allow_cross_node_tp: bool = _opt(False, "run a mesh whose tp or ulysses groups span nodes (refused otherwise: "
                                            "their collectives run once per GEMM)")
    master_addr: str = _opt("127.0.0.1", "the address the spawned ranks' rendezvous listens on (without torchrun); "
                                         "the loopback default is reachable from this machine only")

    # -- data --
    seq_len: int = _opt(2048, "tokens per packed sequence")
    tokenizer: str | None = _opt(None, "a Hugging Face tokenizer.json (or its folder) whose vocabulary fits "
                                       "--vocab-size; default: --init-from's tokenizer.json, else UTF-8 bytes "
                                       "(vocabulary 256)", type=str)
    eod_token: str | None = _opt(None, "end-of-document token appended to every document with --tokenizer; "
                                       "default: tokenizer_config.json's eos_token beside it, else the first of "
                                       "<|end_of_text|>, <|endoftext|>, </s>, <eos> in the vocabulary", type=str)
    data: tuple[str, ...] | None = _opt(None, "training documents: text files (.txt .md .text, one document each), "
                                              ".jsonl (a 'text' field per line), .parquet (a 'text' column), or "
                                              "folders of them; default: the Python standard library's sources",
                                        type=str, nargs="+")
    max_docs: int | None = _opt(None, "use only this many corpus documents", type=int)
    epochs: int = _opt(1, "passes over the training sequences: at their end the run starts over from the first, in "
                          "the same order; a run that would need more passes stops early and says so")
    workers: int = _opt(1, "data-loader workers per rank (they run the planner)")
    eval_every: int = _opt(0, "validation loss on the held-out documents every K steps and at the end (0: never)")
    eval_docs: int = _opt(8, "documents held out of training for the validation loss (with --eval-every)")

    # -- optimizer --
    steps: int = _opt(400, "optimizer steps of the run (a resumed run continues up to this step)")
    lr: float = _opt(3e-3, "AdamW learning rate: the peak of the schedule (--warmup, --lr-min)")
    micro_batches: int = _opt(1, "packed sequences per dp rank per optimizer step, their gradients accumulated: "
                                 "the global batch is micro-batches x dp sequences")
    warmup: int = _opt(0, "steps of linear learning-rate warm-up (step s: lr x s / W), then cosine decay to "
                          "--lr-min at --steps")
    lr_min: float | None = _opt(None, "learning rate of the last step, the end of the cosine decay (default 0.1 x "
                                      "--lr)", type=float)
    weight_decay: float = _opt(0.1, "AdamW's decoupled weight decay on the embedding, head and projection "
                                    "matrices (none on the norm gains)")
    clip: float = _opt(1.0, "clip the gradients to this global norm (0: no clipping; the norm is reported either "
                            "way)")

    # -- precision, memory and compilation: ParallelOptions' dtype, checkpoint_activations, compile, regather --

    # -- checkpoints --
    save_every: int = _opt(0, "checkpoint every K steps and at the end (0: never)")
    resume: str | None = _opt(None, "continue from a checkpoint folder (or a run's checkpoints/ folder: its "
                                    "newest); the mesh may differ; auto: this run's own newest checkpoint under "
                                    "--out if it has one, else a fresh start (the same command for the first launch "
                                    "and every restart)", type=str)
    keep: int = _opt(2, "keep the K newest complete checkpoints, deleting older ones after each save (0: keep "
                        "every one); 2 leaves one to fall back on if the newest is found broken")

    # -- faults: ParallelOptions' timeout, then --
    skip_nonfinite: int = _opt(0, "skip up to N steps whose loss or gradient norm is not finite (their weights and "
                                  "AdamW state untouched, each counted); the next such step ends the job (0: the "
                                  "first one does)")
    watchdog: float | None = _opt(None, "end a rank whose step has made no progress for this many seconds, with one "
                                        "line naming the rank that holds the job up (stopped, frozen or behind), so "
                                        "that the launcher can stop or restart the job; counted from the first step; "
                                        "set it above the slowest step, save and evaluation; default: --timeout; 0: "
                                        "off", type=float)

    # -- output --
    out: str = _opt("runs/train", "folder for metrics.jsonl, summary.json, traces, checkpoints and the ranks' logs")
    check: bool = _opt(False, "compare one step against the single-process model instead of training")
    trace: bool = _opt(False, "write a Chrome/Perfetto trace of the third step, per rank")
    plot: bool = _opt(False, "write train.png: loss curve and per-rank work of the plans")

    def __post_init__(self) -> None:
        super().__post_init__()  # the parallel options
        for name in ("strategy", "device"):
            choices = _FIELDS[name].metadata["choices"]
            if getattr(self, name) not in choices:
                raise ValueError(f"{_flag(name)} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        for name, least in (("nproc", 1), ("dp", 1), ("cp", 1), ("ulysses", 1), ("tp", 1), ("steps", 1), ("epochs", 1),
                            ("threads", 1), ("workers", 0), ("save_every", 0), ("eval_every", 0), ("eval_docs", 1),
                            ("micro_batches", 1)):
            value = getattr(self, name)
            if name == "nproc" and value is None:  # the mesh's size (its sizes are checked next)
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{_flag(name)} must be an integer >= {least}, got {value!r}")
        if self.nproc is None:  # --tp 2 --cp 3 spawns 6 ranks
            object.__setattr__(self, "nproc", self.dp * self.cp * self.ulysses * self.tp)
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.max_docs is not None and self.max_docs < 1:
            raise ValueError(f"max-docs must be None or >= 1, got {self.max_docs}")
        dims = self.dims  # the mesh's rules, with the model and the overlap mode, then the sequence length
        bad = dims.problem(self.model, self.mode) or dims.seq_problem(self.seq_len)
        if bad:
            raise ValueError(bad)
        # tokens, data and the validation loss
        if self.data is not None:
            if isinstance(self.data, (str, Path)) or not self.data:
                raise ValueError(f"data must be a non-empty list of paths, got {self.data!r}")
            object.__setattr__(self, "data", tuple(str(p) for p in self.data))
        # the optimizer; the integers --eval-every, --eval-docs and --micro-batches: the loop above
        if not isinstance(self.warmup, int) or isinstance(self.warmup, bool) or not 0 <= self.warmup <= self.steps:
            raise ValueError(f"warmup must be an integer within [0, --steps = {self.steps}], got {self.warmup!r}")
        if self.lr_min is not None and not 0 <= self.lr_min <= self.lr:
            raise ValueError(f"lr-min must be within [0, --lr = {self.lr}], got {self.lr_min}")
        if not self.weight_decay >= 0 or not self.clip >= 0:
            raise ValueError(f"weight-decay and clip must be >= 0 (clip 0: off), got weight-decay {self.weight_decay}, "
                             f"clip {self.clip}")
        # faults
        for name in ("keep", "skip_nonfinite"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{_flag(name)} must be an integer >= 0, got {value!r}")
        if self.watchdog is not None and (isinstance(self.watchdog, bool) or not isinstance(self.watchdog, int | float)
                                          or not self.watchdog >= 0):
            raise ValueError(f"watchdog must be a number of seconds >= 0 (0: off), got {self.watchdog!r}")
        if not isinstance(self.master_addr, str) or not self.master_addr.strip():
            raise ValueError(f"master-addr must be a host address, got {self.master_addr!r}")

    def options(self) -> ParallelOptions:
        """How the model runs on the mesh: this config's ``ParallelOptions`` fields, as one value."""
        return options_of(self)

    @property
    def check_micro_batches(self) -> int:
        """The micro-batches of ``--check``'s step: ``--micro-batches``, at least 2 (accumulation exercised)."""
        return max(2, self.micro_batches)

    @property
    def watchdog_s(self) -> float:
        """Seconds without progress after which a rank ends (``flashpar.train.watchdog``; 0: never)."""
        return self.timeout if self.watchdog is None else float(self.watchdog)

    @property
    def final_lr(self) -> float:
        """The learning rate of the last step: ``--lr-min``, by default 0.1 x ``--lr``."""
        return 0.1 * self.lr if self.lr_min is None else self.lr_min

    @property
    def dims(self) -> ParallelDims:
        """The mesh's sizes (``flashpar.dims``: its rules, the mesh it builds)."""
        return ParallelDims(self.dp, self.cp, self.ulysses, self.tp)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    def settings(self) -> dict:
        """Every field as JSON values, paths absolute: what a checkpoint records for a resume to continue with."""
        from flashpar.train.resume_settings import settings

        return settings(self)

    def kept(self) -> dict:
        """What a resumed run must share with the checkpoint's run (model, data and seed), as JSON values."""
        from flashpar.train.sources import identity
        from flashpar.train.tokens import load_tokenizer

        return {"model": self.model.to_dict(), "seq_len": self.seq_len, "max_docs": self.max_docs, "seed": self.seed,
                "data": identity(self.data) if self.data else None,
                "tokenizer": load_tokenizer(self.tokenizer, self.eod_token).identity() if self.tokenizer else None,
                "held_out": self.eval_docs if self.eval_every else 0}


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_FLAGS = [name for name, f in _FIELDS.items() if name not in OPTION_FIELDS or f.metadata["group"] is not None]



def _flag(name: str) -> str:
    return name.replace("_", "-")


def _options_in(group: str) -> tuple[str, ...]:
    """``ParallelOptions``' flags of ``--help`` group ``group``, in their field order."""
    return tuple(name for name, f in OPTION_FIELDS.items() if f.metadata["group"] == group)


GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("the model", ("model", "init_from", "seed")),
    (MESH, ("nproc", "dp", "cp", "ulysses", "tp", "strategy", *_options_in(MESH), "device", "threads",
            "allow_cross_node_tp", "master_addr")),
    ("data", ("seq_len", "tokenizer", "eod_token", "data", "max_docs", "epochs", "workers", "eval_every",
              "eval_docs")),
    ("optimizer", ("steps", "lr", "micro_batches", "warmup", "lr_min", "weight_decay", "clip")),
    (MEMORY, _options_in(MEMORY)),
    ("checkpoints", ("save_every", "resume", "keep")),
    (FAULTS, (*_options_in(FAULTS), "skip_nonfinite", "watchdog")),
    ("output", ("out", "check", "trace", "plot")),
)
"""``TrainConfig``'s flags by concept, in the order ``flashpar train --help`` shows them: its own fields, and
``ParallelOptions``' in the group each names (a test checks that every flag is in exactly one group; a field of
``ParallelOptions`` without a group is the library's setting, not a flag)."""


GIVEN = "flags_given"
"""The parsed flags' attribute naming the fields whose flags were on the command line (a resume takes the others
from its checkpoint: ``flashpar.train.resume_settings``)."""


def _mark(namespace, dest: str) -> None:
    given = getattr(namespace, GIVEN, None)
    if given is None:
        given = set()
        setattr(namespace, GIVEN, given)
    given.add(dest)


class _Store(argparse.Action):
    """argparse's ``store``, noting that the flag was given."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        _mark(namespace, self.dest)


class _StoreTrue(argparse.Action):
    """argparse's ``store_true``, noting that the flag was given."""

    def __init__(self, option_strings, dest, default=False, help=None):
        super().__init__(option_strings, dest, nargs=0, const=True, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)
        _mark(namespace, self.dest)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``flashpar train``'s flags, one per field, in ``GROUPS``' argument groups (the model's sizes:
    ``LlamaConfig``'s fields)."""
    for title, names in GROUPS:
        _add_group(p.add_argument_group(title), names)


def _add_group(p, names: tuple[str, ...]) -> None:
    for f in (_FIELDS[name] for name in names):
        if f.name == "model":
            for name in MODEL_FLAGS:
                p.add_argument(f"--{_flag(name)}", type=int, default=getattr(LlamaConfig, name), action=_Store,
                               help=f"model: {name.replace('_', ' ')} (default %(default)s)")
            p.add_argument("--hf-config", default=None, action=_Store,
                           help="a Hugging Face Llama config.json (overrides the sizes)")
            continue
        doc = f.metadata["doc"]
        if f.type == "bool":
            p.add_argument(f"--{_flag(f.name)}", action=_StoreTrue, help=doc)
            continue
        kw = {k: f.metadata[k] for k in ("choices", "nargs") if k in f.metadata}
        kind = f.metadata.get("type", type(f.default))
        shown = "" if f.default is None else " (default %(default)s)"
        p.add_argument(f"--{_flag(f.name)}", type=kind, default=f.default, help=doc + shown, action=_Store, **kw)


def from_args(args: argparse.Namespace) -> TrainConfig:
    """The config of the parsed flags (``ValueError`` / ``FileNotFoundError``: one line)."""
    if args.hf_config:
        model = LlamaConfig.from_hf(args.hf_config)
    else:
        model = LlamaConfig(**{name: getattr(args, name) for name in MODEL_FLAGS})
    if getattr(args, "init_from", None):  # the sizes are the folder's
        model = _init_from_model(args, model)
    values = {name: getattr(args, name) for name in _FLAGS if name != "model"}
    if getattr(args, "resume", None) == AUTO:  # the run's own newest checkpoint, or a fresh start
        found = auto_folder(values["out"])
        if found is None:
            _say_once(f"--resume auto: no checkpoint in {Path(values['out']) / 'checkpoints'}: a fresh start")
        args.resume = values["resume"] = None if found is None else str(found)
    if getattr(args, "resume", None):  # the checkpoint's settings, but for the flags given now
        values, model = _resumed(args, values, model)
    return TrainConfig(model=model, **values)


def _resumed(args: argparse.Namespace, values: dict, model: LlamaConfig) -> tuple[dict, LlamaConfig]:
    """``values`` and ``model`` with every setting whose flag was not given taken from the checkpoint that
    ``--resume`` names (``flashpar.train.resume_settings``); one line says so (rank 0 under torchrun)."""
    from flashpar.train import resume_settings

    saved = resume_settings.saved(args.resume)
    if saved is None:  # a checkpoint saved without settings: the flags given, checked against it later
        return values, model
    given = set(getattr(args, GIVEN, set()))
    if given & {*MODEL_FLAGS, "hf_config", "init_from"}:
        given.add("model")
    merged, taken = resume_settings.merged({**values, "model": model.to_dict()}, given, saved)
    model_value = merged.pop("model")
    model = LlamaConfig(**model_value) if isinstance(model_value, dict) else model_value
    changed = sorted(f"--{_flag(n)}" for n in given if n in _FIELDS and n not in ("resume", "model"))
    _say_once(f"--resume {args.resume}: the run's settings from its checkpoint ({len(taken)} taken"
              f"{'; given here: ' + ', '.join(changed) if changed else ''})")
    return merged, model


def _say_once(line: str) -> None:
    """``line`` on standard error, once for the job (rank 0 under torchrun)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"flashpar train: {line}", file=sys.stderr, flush=True)


def _init_from_model(args: argparse.Namespace, model: LlamaConfig) -> LlamaConfig:
    """The model of ``--init-from``'s config.json; ``ValueError`` if ``--hf-config`` or size flags say otherwise."""
    folder = LlamaConfig.from_hf(args.init_from)  # FileNotFoundError / ValueError: one line
    if args.hf_config and model != folder:
        raise ValueError(f"--hf-config {args.hf_config} and --init-from {args.init_from} describe different models")
    given = {n: getattr(args, n) for n in MODEL_FLAGS if getattr(args, n) != getattr(LlamaConfig, n)}
    differ = {n: v for n, v in given.items() if v != getattr(folder, n)}
    if differ:
        raise ValueError(f"--init-from {args.init_from} has " + ", ".join(f"{n.replace('_', ' ')} {getattr(folder, n)}"
                                                                          for n in differ)
                         + " but " + ", ".join(f"--{_flag(n)} {v}" for n, v in differ.items())
                         + " was given (the sizes are the folder's: drop the size flags)")
    return folder


def writable(out: Path) -> None:
    """``ValueError`` (one line) unless ``out`` exists or can be made, and takes a file.  Each process writes and
    removes its own probe: torchrun's ranks check the same folder at the same time."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test.{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"output folder {out} is not writable: {err.strerror or err}") from err


def ready(config: TrainConfig, world_size: int) -> TrainConfig:
    """Check what the run needs around it, before any process starts; returns ``config`` with ``resume``
    resolved to one checkpoint folder.  ``ValueError`` / ``FileNotFoundError`` with one line."""
    if config.world_size != world_size:
        raise ValueError(f"mesh dp x cp x ulysses x tp = {config.dp} x {config.cp} x {config.ulysses} x {config.tp} "
                         f"= {config.world_size} does not match the {world_size} processes: run it with --nproc "
                         f"{config.world_size} or without --nproc (under torchrun: {config.world_size} processes in "
                         f"all), or choose a mesh whose product is {world_size}")
    local = local_world_size(world_size)  # torchrun's ranks on this node
    problem = config.dims.node_problem(local)
    if problem and not config.allow_cross_node_tp:
        raise ValueError(problem)
    if config.device == "cuda":
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have == 0:
            raise ValueError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
        if local > have:  # rank r takes cuda:r: NCCL cannot run two ranks on one GPU
            raise ValueError(f"--device cuda: {local} ranks on this machine need {local} GPUs (one per rank), but "
                             f"{have} {'is' if have == 1 else 'are'} available")
    from flashpar.train.tokenizer_choice import choose

    tokenizer, line = choose(config.tokenizer, config.init_from)  # a folder's own tokenizer, or one line
    if line is not None and os.environ.get("RANK", "0") == "0":
        print(f"flashpar train: {line}", file=sys.stderr, flush=True)
    config = dataclasses.replace(config, tokenizer=tokenizer)
    writable(Path(config.out))
    from flashpar.corpus import document_lengths

    try:
        tokens = sum(document_lengths(config.max_docs)) if not config.data else None  # --data: checked below
    except FileNotFoundError as err:
        raise ValueError(f"no training documents: {err}") from err
    micro = config.check_micro_batches if config.check else config.micro_batches
    if tokens is not None and tokens < config.seq_len * config.dp * micro:
        raise ValueError(f"the corpus has {tokens} tokens, fewer than one global batch "
                         f"({micro} x {config.dp} x {config.seq_len})")
    if config.plot:
        from flashpar.train.report import have_matplotlib

        if not have_matplotlib():
            raise ValueError("--plot needs matplotlib (pip install 'flashpar[plot]')")
    if config.resume == AUTO:  # a config made in Python: the run's own newest checkpoint, or a fresh start
        found = auto_folder(config.out)
        config = dataclasses.replace(config, resume=None if found is None else str(found))
    if config.resume:
        from flashpar.train import checkpoint

        resume = checkpoint.resolve(Path(config.resume))  # checked (checksums), or skipped / refused: one line each
        checkpoint.read_meta(resume, config)  # same model, data and seed, or one line
        config = dataclasses.replace(config, resume=str(resume))
    if config.init_from:  # the weights fit the model (names, shapes), read from the headers only
        from flashpar.models.hf import WeightFiles

        with WeightFiles(config.init_from, config.model):  # FileNotFoundError / ValueError: one line
            pass
    from flashpar.train.data import ready_data

    ready_data(config)  # tokenizer, data files, the token cache (built here), held-out documents: one line each
    if "RANK" not in os.environ:  # the spawn launcher's rendezvous can listen on --master-addr
        from flashpar.ranks import can_listen

        can_listen(config.master_addr)  # ValueError: one line
    return config

"""Checkpoints of the trainer with ``torch.distributed.checkpoint``, resumable on another mesh shape, saved atomically
and checked before they are read.

A checkpoint holds the model and the AdamW moments as the single-process model's *full* tensors,
under its parameter names (tp shards gathered with ``ParallelLlama.to_full``): every rank holds the
same values, which DCP writes once.  Loading fills full tensors and each rank takes its shards
(``ParallelLlama.shard_of``), whatever the mesh was when saving: both read the parameter-layout table
``flashpar.models.layout.LAYOUT``.  ``meta.json`` (rank 0) records the
step, the global sequences consumed (``sequences_after``: ``steps x dp x micro-batches`` from the
start; the data loader resumes there, whatever the new run's dp and micro-batches) and what must
not change across a resume (``TrainConfig.kept()``: model sizes, sequence length, corpus and seed).
The AdamW state is keyed by parameter (``opt.state``), whatever its parameter groups
(``flashpar.train.optimizer``); the learning rate is not saved: it is a function of the step
(``flashpar.train.schedule``).

Saving (``save``, collective) is all or nothing (``flashpar.train.atomic``)::

    every rank    full state; all finite?  (else: nothing written, JobStop)
    rank 0        sweep leftovers of killed saves; mkdir  checkpoints/.step_N.partial/
    every rank    dcp.save into it (DCP fsyncs its files)
    every rank    SHA-256 + fsync of its share of the files (file i on rank i mod world), gathered
    rank 0        meta.json, then the completion marker flashpar.json (step, sequences, config, every
                  file's size and SHA-256) LAST; fsync the folder; rename to step_N; fsync checkpoints/
    rank 0        --keep K: delete all but the K newest complete checkpoints (renamed away first)

A process killed at any moment leaves ``step_N`` either absent (a ``.partial`` folder, swept by the
next save) or complete; the checkpoints saved before are not touched until the new one is
published.  Each phase's errors (a full disk, an unwritable folder) are gathered on every rank
(``all_gather_object``), so every rank raises the same one-line ``JobStop`` and none waits for a peer.

Reading.  DCP reads ``.metadata`` with ``pickle``: a checkpoint is code that runs when loaded.  No
file of a folder is handed to DCP unless the folder carries ``flashpar.json`` and every file it lists
has its size and SHA-256 (``verify``): a folder without it (a foreign one, or one written before
these checks: ``python -m flashpar.train.checkpoint trust FOLDER`` describes it, for checkpoints you
made yourself) or with a file that differs is refused with one line naming the file, before DCP
opens anything.  ``latest`` on a run's ``checkpoints/`` folder takes the newest step that passes and
says why it skipped each newer one.  The checksums only say that the files are those that were
saved: a checkpoint must still come from a trusted source (README, "Failures and recovery").
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from flashpar.models import LlamaConfig
from flashpar.train import atomic, handoff
from flashpar.train.marker import MARKER, step_of
from flashpar.train.resume_settings import difference_line
from flashpar.train.stop import JobStop

MOMENTS = ("exp_avg", "exp_avg_sq")
# what a checkpoint without these keys was made with
MISSING_KEY_DEFAULTS = {"data": None, "tokenizer": None, "held_out": 0}
FORMAT, VERSION = "flashpar checkpoint", 1
REQUIRED = (".metadata", "meta.json")  # DCP's index (the pickle) and ours: a marker must list both
MAX_MARKER_BYTES = 4 << 20


class BrokenCheckpoint(ValueError):
    """A checkpoint folder that must not be read: one line naming the folder and the file."""


class RunConfig(Protocol):
    """What a checkpoint reads of its run's ``flashpar.train.config.TrainConfig``: the mesh, the micro-batches and
    what must not change across a resume (``kept``); ``save`` hands it on to ``handoff.sources`` (the files
    ``flashpar export`` puts beside the weights).  The config checks a resume against its checkpoint: the import
    runs from the config to here."""

    dp: int
    cp: int
    ulysses: int
    tp: int
    micro_batches: int

    def kept(self) -> dict: ...

    def settings(self) -> dict: ...


def sequences_after(start: int, steps: int, dp: int, micro_batches: int) -> int:
    """The global sequences consumed once ``steps`` steps of ``micro_batches`` sequences per dp rank (``dp``
    ranks) have run from global sequence ``start``: dp rank ``d``'s micro-batch ``m`` of step ``s`` (0-based,
    counted from ``start``) is the global sequence ``start + (s M + m) dp + d``."""
    return start + steps * dp * micro_batches


# ---- saving ----------------------------------------------------------------------------------------------------


def save(path: Path, model, opt, step: int, config: RunConfig, sequences: int | None = None, *,
         keep: int = 0) -> None:
    """Write step ``step`` to ``path`` atomically (collective: every rank calls it; see the module docstring);
    ``sequences``: the global sequences consumed (default: a run from sequence 0 with this config's dp and
    micro-batches); ``keep > 0``: then delete all but the ``keep`` newest complete checkpoints beside it.
    ``JobStop`` (one line, every rank) if it cannot be written; the checkpoints saved before stay."""
    path = Path(path)
    if sequences is None:
        sequences = sequences_after(0, step, config.dp, config.micro_batches)
    state = _full_state(model, opt)  # the same full tensors on every rank: every rank decides the same
    bad = [f"{k}.{n}" for k, group in state.items() for n, t in group.items() if not bool(torch.isfinite(t).all())]
    if bad:
        raise JobStop(f"checkpoint {path} not written: the state of step {step} holds non-finite values "
                      f"({', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''})")
    rank, world = dist.get_rank(), dist.get_world_size()
    partial = atomic.partial_of(path)

    def prepare():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.sweep(path.parent)  # .partial / .trash folders of killed saves (this one's too)
        partial.mkdir()

    def write():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(partial), sync_files=True))

    def checksums():  # file i on rank i mod world (the folder is on a file system every rank sees)
        names = sorted(p.name for p in partial.iterdir() if p.is_file())
        return atomic.describe(partial, names[rank::world])

    def publish(files):
        meta = {"step": step, "sequences": sequences, "mesh": [config.dp, config.cp, config.ulysses, config.tp],
                "micro_batches": config.micro_batches, **config.kept(),
                "options": model.options.to_dict(),  # how the run ran (the mesh may differ on resume)
                "sources": handoff.sources(config),  # what flashpar export puts beside the weights
                "settings": config.settings()}  # what a resume continues with (flashpar.train.resume_settings)
        atomic.write_json(partial / "meta.json", meta)
        files = {**files, **atomic.describe(partial, ["meta.json"])}
        atomic.write_json(partial / MARKER, {"format": FORMAT, "version": VERSION, "step": step,
                                             "sequences": sequences, "config": config.kept(), "files": files})
        atomic.publish(partial, path)

    _on_every_rank(path, step, "creating its folder", prepare if rank == 0 else None)
    _on_every_rank(path, step, "writing", write)
    shares = _on_every_rank(path, step, "checksumming", checksums)
    files = {name: entry for share in shares for name, entry in share.items()}
    _on_every_rank(path, step, "publishing", (lambda: publish(files)) if rank == 0 else None)
    if rank == 0 and keep > 0:
        try:
            prune(path.parent, keep, protect=path)
        except OSError as err:  # the new checkpoint is saved: an old one left behind is not worth stopping for
            print(f"flashpar: could not delete an old checkpoint in {path.parent}: {_one_line(err)}", file=sys.stderr)


def prune(parent: Path, keep: int, *, protect: Path | None = None) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints (``step_*`` with a marker) of ``parent`` (never
    ``protect``); a deleted one is renamed away first (``atomic.remove``).  Returns what it deleted."""
    complete = sorted((d for d in parent.glob("step_*") if step_of(d) is not None and (d / MARKER).is_file()),
                      key=step_of)
    old = [d for d in complete[:-keep] if protect is None or d.resolve() != Path(protect).resolve()]
    for d in old:
        atomic.remove(d)
    return old


def _on_every_rank(path: Path, step: int, what: str, fn: Callable | None) -> list:
    """Run ``fn`` (``None``: nothing) on this rank, gather every rank's result or error, and return the
    results, or raise the first error as ``JobStop`` on every rank (a collective: no rank waits alone)."""
    error, value = None, None
    try:
        value = fn() if fn is not None else None
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - reported as one line on every rank
        error = _one_line(err)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (error, value))
    failed = [(r, e) for r, (e, _) in enumerate(gathered) if e is not None]
    if failed:
        r, e = failed[0]
        if dist.get_rank() == 0 and what != "creating its folder":
            atomic.sweep(path.parent)  # best effort: the .partial of this save
        raise JobStop(f"checkpoint {path} (step {step}) not saved: {what} failed on rank {r}: {e}; the checkpoints "
                      "saved before are intact")
    return [v for _, v in gathered]


def _one_line(err: BaseException) -> str:
    """An error as one line: an ``OSError``'s reason and file, the first failure inside DCP's exception."""
    if isinstance(err, CheckpointException) and err.failures:
        err = next(iter(err.failures.values()))[0]
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}" + (f": {err.filename}" if err.filename else "")
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[-1] if text else ''}"


# ---- checking and finding --------------------------------------------------------------------------------------


def verify(folder: Path, names=None) -> dict:
    """The completion marker of checkpoint ``folder`` once every file it lists (or those of ``names``) has its
    size and SHA-256; ``BrokenCheckpoint`` (one line naming the file) otherwise.  Reads no pickle."""
    folder = Path(folder)
    marker = _marker(folder)
    listed = marker["files"]
    for name in sorted(listed if names is None else names):
        if name not in listed:
            raise BrokenCheckpoint(f"checkpoint {folder} is broken: {MARKER} does not list {name}")
        path, want = folder / name, listed[name]
        try:
            info = os.lstat(path)
        except OSError as err:
            raise BrokenCheckpoint(f"checkpoint {folder} is broken: {path} is missing ({_one_line(err)})") from None
        if not stat.S_ISREG(info.st_mode):
            raise BrokenCheckpoint(f"checkpoint {folder} is broken: {path} is not a regular file")
        if info.st_size != want["bytes"]:
            raise BrokenCheckpoint(f"checkpoint {folder} is broken: {path} has {info.st_size} bytes, {MARKER} says "
                                   f"{want['bytes']} (truncated or replaced)")
        if atomic.sha256(path) != want["sha256"]:
            raise BrokenCheckpoint(f"checkpoint {folder} is broken: {path} differs from its SHA-256 in {MARKER} "
                                   "(the file changed after the save)")
    return marker


def _marker(folder: Path) -> dict:
    """``folder``'s ``flashpar.json``, checked for its shape (no file read but the marker)."""
    path = folder / MARKER
    if not path.is_file():
        if _is_checkpoint(folder):
            raise BrokenCheckpoint(
                f"checkpoint {folder} has no {MARKER} (written before flashpar checked its checkpoints, or not by "
                f"flashpar) and its .metadata is a pickle that runs code when read: refused; if you made it and "
                f"trust it, describe it with: python -m flashpar.train.checkpoint trust {folder}")
        raise BrokenCheckpoint(f"{folder} is not a checkpoint: no {MARKER}")
    try:
        if path.stat().st_size > MAX_MARKER_BYTES:
            raise ValueError(f"larger than {MAX_MARKER_BYTES} bytes")
        marker = json.loads(path.read_text())
        if not isinstance(marker, dict) or marker.get("format") != FORMAT:
            raise ValueError(f"no 'format': {FORMAT!r}")
        if not isinstance(marker.get("version"), int) or marker["version"] > VERSION:
            raise ValueError(f"version {marker.get('version')!r} is not one this flashpar reads (<= {VERSION})")
        if not isinstance(marker.get("step"), int) or not isinstance(marker.get("files"), dict):
            raise ValueError("no integer step and files table")
        for name, entry in marker["files"].items():
            if not _plain_name(name):
                raise ValueError(f"file name {name!r} is not a plain name in the folder")
            if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and _is_hex(entry.get("sha256"))):
                raise ValueError(f"{name}: no bytes and sha256")
        missing = [n for n in REQUIRED if n not in marker["files"]]
        if missing:
            raise ValueError(f"it does not list {', '.join(missing)}")
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise BrokenCheckpoint(f"checkpoint {folder} is broken: {path} is not flashpar's description: {err}") from None
    return marker


def _plain_name(name) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..", MARKER) and not any(c in name for c in "/\\\0")


def _is_hex(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is meant as one checkpoint (not a folder of them): it has a marker, meta.json or .metadata."""
    return any((path / name).is_file() for name in (MARKER, *REQUIRED))


def _say(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank resolves: one of them says it
        print(f"flashpar: {line}", file=sys.stderr)


def resolve(path: Path, say: Callable[[str], None] | None = _say) -> Path:
    """``latest``, then say which checkpoint it is (``--resume``)."""
    folder = latest(path, say)
    if say is not None:
        say(f"resuming from {folder} (step {_marker(folder)['step']}, its checksums pass)")
    return folder


def latest(path: Path, say: Callable[[str], None] | None = _say) -> Path:
    """The checkpoint to read: ``path`` itself if it is one (``BrokenCheckpoint`` if it does not pass
    ``verify``), else its newest ``step_*`` that passes (``say`` gets one line per newer one skipped, and why).
    Every file of the one returned has its checksum."""
    path = Path(path)
    if _is_checkpoint(path):
        verify(path)
        return path
    steps = sorted((d for d in path.glob("step_*") if step_of(d) is not None), key=step_of, reverse=True)
    if not steps:
        raise FileNotFoundError(f"no checkpoint ({MARKER}) at {path} or in its step_* folders")
    reasons = []
    for folder in steps:
        try:
            verify(folder)
            return folder
        except BrokenCheckpoint as err:
            reasons.append(str(err))
            if say is not None:
                say(f"skipping {err}")
    raise BrokenCheckpoint(f"no checkpoint in {path} passes its checks ({len(steps)} refused; the newest: "
                           f"{reasons[0]})")


def read_meta(path: Path, config: RunConfig) -> dict:
    """The checkpoint's meta data; ``ValueError`` if the run would not continue the same training."""
    path = Path(path)
    where = (path if _is_checkpoint(path) else latest(path)) / "meta.json"
    try:
        meta = json.loads(where.read_text())
        if not isinstance(meta, dict) or not all(isinstance(meta.get(k), int) for k in ("step", "sequences")):
            raise ValueError("no integer step and sequences")
        # a checkpoint written before a setting existed was made with its default (the data, tokenizer,
        # held_out and model fields may be missing); the model dict is read back through LlamaConfig
        meta = {**MISSING_KEY_DEFAULTS, **meta}
        meta["model"] = LlamaConfig(**meta["model"]).to_dict() if isinstance(meta.get("model"), dict) else None
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"checkpoint {where} is not a flashpar meta.json: {err}") from None
    kept = config.kept()
    differ = [k for k in kept if meta.get(k) != kept[k]]
    if differ:  # one line by flag
        raise ValueError(difference_line(path, differ, meta, kept))
    return meta


# ---- loading ---------------------------------------------------------------------------------------------------


def load(path: Path, model, opt) -> None:
    """Fill this rank's parameters and AdamW state from the checkpoint (collective).  Every file is checked
    against the marker first, file i on rank i mod world (``BrokenCheckpoint`` on every rank): the folder
    may have changed since the launcher chose it, and DCP is not handed a file that did not pass."""
    path = Path(path)
    folder = path if _is_checkpoint(path) else latest(path, say=None)
    rank, world = dist.get_rank(), dist.get_world_size()
    error = None
    try:
        names = sorted(_marker(folder)["files"])
        verify(folder, names[rank::world])
    except BrokenCheckpoint as err:
        error = str(err)
    errors = [None] * world
    dist.all_gather_object(errors, error)
    if any(errors):
        raise BrokenCheckpoint(next(e for e in errors if e))
    state = _full_state(model, opt, empty=True)
    dcp.load(state, checkpoint_id=str(folder))
    step = float(state["optim"]["step"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(model.shard_of(name, state["model"]))
            opt.state[p] = {"step": torch.tensor(step),
                            **{m: model.shard_of(name, state[m]).clone().to(p.device) for m in MOMENTS}}


def _full_state(model, opt, empty: bool = False) -> dict:
    params = dict(model.named_parameters())
    moments = {m: {n: opt.state.get(p, {}).get(m, torch.zeros_like(p)) for n, p in params.items()} for m in MOMENTS}
    state = {"model": model.to_full({n: p.detach() for n, p in params.items()}),
             **{m: model.to_full(moments[m]) for m in MOMENTS}}
    steps = [float(s["step"]) for s in opt.state.values() if "step" in s]
    state["optim"] = {"step": torch.tensor(max(steps, default=0.0), dtype=torch.float64)}
    if empty:
        state = {k: {n: torch.empty_like(t) for n, t in v.items()} for k, v in state.items()}
    return {k: {n: t.cpu() for n, t in v.items()} for k, v in state.items()}


# ---- re-trusting a checkpoint made before the marker -----------------------------------------------------------


def trust(folder: Path) -> Path:
    """Write the marker of a checkpoint made before markers existed (``meta.json`` and ``.metadata``, no
    ``flashpar.json``), from its files as they are now: only for a folder you made and trust (its pickle runs
    when read).  Returns the marker's path."""
    folder = Path(folder)
    if (folder / MARKER).exists():
        raise ValueError(f"{folder} already has {MARKER}")
    missing = [n for n in REQUIRED if not (folder / n).is_file()]
    if missing:
        raise ValueError(f"{folder} is not a flashpar checkpoint: no {', '.join(missing)}")
    meta = json.loads((folder / "meta.json").read_text())
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise ValueError(f"{folder / 'meta.json'} has no integer step")
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.is_symlink() and _plain_name(p.name))
    files = atomic.describe(folder, names)
    partial = folder / f".{MARKER}{atomic.PARTIAL}"
    atomic.write_json(partial, {"format": FORMAT, "version": VERSION, "step": meta["step"],
                                "sequences": meta.get("sequences"), "config": {k: v for k, v in meta.items()
                                                                               if k not in ("step", "sequences")},
                                "files": files})
    os.rename(partial, folder / MARKER)
    atomic.fsync_dir(folder)
    return folder / MARKER


def main(argv: list[str] | None = None) -> int:
    """``python -m flashpar.train.checkpoint trust FOLDER``: ``trust`` (one line either way)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "trust":
        print("usage: python -m flashpar.train.checkpoint trust FOLDER  (describe a checkpoint you made before "
              "flashpar checked its checkpoints, so that --resume and export read it)", file=sys.stderr)
        return 2
    try:
        marker = trust(Path(argv[1]))
    except (OSError, ValueError) as err:
        print(f"flashpar: {err}", file=sys.stderr)
        return 2
    print(f"wrote {marker}: the checkpoint's files as they are now (trusted by you)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

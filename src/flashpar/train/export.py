"""``flashpar export CHECKPOINT --hf OUT``: a training checkpoint as a Hugging Face Llama folder.

A checkpoint (``flashpar.train.checkpoint``) holds the single-process model's full tensors under its
parameter names (``model.<name>`` in the DCP metadata) and ``meta.json`` with the model's config
(``TrainConfig.kept()["model"]``: ``LlamaConfig.to_dict()``).  One process reads them without a process
group (``dcp.load(..., no_dist=True)``), into tensors of the stored shapes and dtypes, checked
against the config, and writes ``save_hf`` of the model: ``LlamaForCausalLM.from_pretrained(OUT)``
loads it.  A missing or invalid checkpoint is one line (``ValueError`` / ``FileNotFoundError``).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

from flashpar.models import Llama, LlamaConfig, save_hf
from flashpar.models.hf import empty_llama, expected_shapes
from flashpar.train.checkpoint import latest


def read_model(path) -> Llama:
    """The single-process model of checkpoint ``path`` (or the newest ``step_*`` in it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = latest(Path(path))  # FileNotFoundError: one line
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
        cfg = LlamaConfig(**meta["model"])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{ckpt / 'meta.json'} is not readable JSON: {err}") from None
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{ckpt / 'meta.json'} holds no valid model config: {err}") from None
    try:
        stored = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    except Exception as err:  # noqa: BLE001 - torch raises several kinds for a missing or torn .metadata
        raise ValueError(f"{ckpt} is not a torch.distributed.checkpoint folder: {err}") from None
    want = expected_shapes(cfg)
    missing = [n for n in want if f"model.{n}" not in stored]
    shaped = [n for n in want if n not in missing and tuple(getattr(stored[f"model.{n}"], "size", ())) != want[n]]
    if missing or shaped:
        raise ValueError(f"{ckpt}: the checkpoint does not fit its meta.json model: "
                         + "; ".join(([f"missing {', '.join(missing[:4])}"] if missing else [])
                                     + ([f"mis-shaped {', '.join(shaped[:4])}"] if shaped else [])))
    state = {"model": {n: torch.empty(want[n], dtype=stored[f"model.{n}"].properties.dtype) for n in want}}
    try:
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    except Exception as err:  # noqa: BLE001 - a torn data file
        raise ValueError(f"{ckpt}: reading the model tensors failed: {str(err).strip().splitlines()[-1]}") from None
    model = empty_llama(cfg)
    model.load_state_dict(state["model"], assign=True, strict=True)
    return model


def export(checkpoint, out) -> Path:
    """Write checkpoint ``checkpoint``'s model to the Hugging Face folder ``out``; returns it."""
    return save_hf(read_model(checkpoint), out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint folder (meta.json), or a run's checkpoints/ folder: its newest")
    p.add_argument("--hf", required=True, metavar="OUT", help="the Hugging Face folder to write (config.json, "
                                                             "model.safetensors)")


def run(args: argparse.Namespace) -> int:
    try:
        out = export(args.checkpoint, args.hf)
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"flashpar export: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}")
    return 0

"""``flashpar export CHECKPOINT --hf OUT``: a training checkpoint as a Hugging Face folder of its model's family.

A checkpoint (``flashpar.train.checkpoint``) holds the single-process model's full tensors under its
parameter names (``model.<name>`` in the DCP metadata) and ``meta.json`` with the model's config
(``TrainConfig.kept()["model"]``: ``LlamaConfig.to_dict()``).  One process reads them without a process
group (``dcp.load(..., no_dist=True)``), into tensors of the stored shapes and dtypes, checked
against the config, and writes ``save_hf`` of the model: its family's class (``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``: ``flashpar.models.families``) loads it with
``from_pretrained(OUT)``, unpadded (the parallel model's vocabulary padding is not in a checkpoint).  A missing
or invalid checkpoint is one line (``ValueError`` / ``FileNotFoundError``).

Beside the weights, what ``AutoTokenizer.from_pretrained(OUT)`` and ``generate`` need (``flashpar.train.handoff``):
the tokenizer's files (``--tokenizer``, else the run's ``--tokenizer``, which the checkpoint records) and
``generation_config.json`` (the ``--init-from`` folder's, else one whose ``eos_token_id`` is the run's
end-of-document token, so that generation stops there).  Every file written has the ordinary mode of a new
file (``0666`` less the umask).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flashpar.models import Llama

# torch, the model and the checkpoint reader are imported by the functions that use them: `flashpar export --help`
# builds its flags without torch.


def read_model(path) -> Llama:
    """The single-process model of checkpoint ``path`` (or the newest ``step_*`` in it)."""
    from flashpar.train.checkpoint import latest

    return _read(latest(Path(path)))  # FileNotFoundError: one line


def _read(ckpt: Path) -> Llama:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from flashpar.models import LlamaConfig
    from flashpar.models.hf import empty_llama, expected_shapes

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


def export(checkpoint, out, tokenizer=None) -> list[str]:
    """Write checkpoint ``checkpoint``'s model to the Hugging Face folder ``out`` with its tokenizer and generation
    config (``tokenizer``: a folder or ``tokenizer.json`` instead of the run's); the names of the files written."""
    from flashpar.models import save_hf
    from flashpar.train import handoff
    from flashpar.train.checkpoint import latest

    ckpt = latest(Path(checkpoint))  # FileNotFoundError: one line
    sources = handoff.sources_of(ckpt)
    model = _read(ckpt)
    out = save_hf(model, out)
    written = ["config.json", "model.safetensors"]
    written += handoff.copy_tokenizer(tokenizer or sources.get("tokenizer"), out, sources.get("eod_token"))
    written += handoff.write_generation_config(sources.get("init_from"), out, sources.get("eod"))
    handoff.ordinary_modes(out, written)
    return written


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint folder (meta.json), or a run's checkpoints/ folder: its newest")
    p.add_argument("--hf", required=True, metavar="OUT", help="the Hugging Face folder to write (config.json, "
                                                             "model.safetensors, tokenizer, generation_config.json)")
    p.add_argument("--tokenizer", metavar="PATH", help="the tokenizer to put beside the weights (a folder or "
                                                       "tokenizer.json; default: the run's --tokenizer)")


def run(args: argparse.Namespace) -> int:
    try:
        written = export(args.checkpoint, args.hf, args.tokenizer)
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"flashpar export: {err}", file=sys.stderr)
        return 2
    missing = [] if "tokenizer.json" in written else ["no tokenizer (the run had none: bytes; or pass --tokenizer)"]
    print(f"wrote {Path(args.hf)}: {', '.join(written)}" + (f"; {missing[0]}" if missing else ""))
    return 0

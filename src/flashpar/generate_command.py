"""``flashpar generate``: prefill a batch of prompts packed over a (tp, cp) mesh and decode them.

    flashpar generate --init-from HF_FOLDER --prompts FILE --tp T --cp C --max-new-tokens N --out OUT.jsonl
    flashpar generate --checkpoint DIR ...          (a flashpar training checkpoint, or a run's checkpoints/)

``FILE``: ``.jsonl`` with ``text`` (tokenized by the folder's ``tokenizer.json`` or ``--tokenizer``) or
``tokens``, or ``.txt`` (one prompt a line).  ``OUT``: one line per prompt in input order, ``{"id", "prompt_tokens",
"tokens", "text"}`` (text where a tokenizer is known).  Without a launcher it spawns ``T x C`` CPU processes on
gloo; under ``torchrun`` (``RANK`` set) each process is one rank (``--device cuda``: NCCL).  The arguments,
the model's config and the prompts are checked before any process starts (one line, exit 2); a rank that
fails prints one line naming itself.  Rank 0 prints the time to first token, prefill tokens/s and decode
tokens/s at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from flashpar.infer.prompts import Prompt, read_prompts

NAME = "flashpar generate"
FAILED = 2  # a rank's exit status after printing its line


@dataclass(frozen=True)
class GenerateConfig:
    prompts: str
    init_from: str | None = None
    checkpoint: str | None = None
    tokenizer: str | None = None
    tp: int = 1
    cp: int = 1
    ulysses: int = 1
    max_new_tokens: int = 32
    out: str | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    eos_id: int | None = None
    strategy: str = "flashcp"
    mode: str = "auto"
    dtype: str = "fp32"
    device: str = "cpu"
    timeout: float = 300.0
    master_addr: str = "127.0.0.1"
    progress: bool = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--init-from", help="a Hugging Face Llama folder (config.json, safetensors)")
    src.add_argument("--checkpoint", help="a flashpar training checkpoint (or a run's checkpoints/ folder: its newest)")
    p.add_argument("--prompts", required=True, help=".jsonl ('text' or 'tokens' a line) or .txt (one prompt a line)")
    p.add_argument("--tokenizer", help="a tokenizer.json (default: the --init-from folder's, where it has one)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--ulysses", type=int, default=1, help="must be 1: decode splits heads over --tp")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", help="write one JSON line per prompt here")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eos-id", type=int, help="the end-of-text token (default: the tokenizer's end of document)")
    p.add_argument("--strategy", default="flashcp", help="the context-parallel plan of the prefill")
    p.add_argument("--mode", default="auto", help="FlashOverlap's mode of the prefill's tensor-parallel linears")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def _tokenizer(config: GenerateConfig, vocab_size: int):
    """``(encode, decode, eod)`` of the tokenizer, or ``(None, None, None)`` where none is known."""
    path = config.tokenizer
    if path is None and config.init_from is not None and (Path(config.init_from) / "tokenizer.json").is_file():
        path = config.init_from
    if path is None:
        return None, None, None
    from tokenizers import Tokenizer

    from flashpar.train.tokens import load_tokenizer

    try:
        eod = load_tokenizer(path, vocab_size=vocab_size).eod  # checked against the model's vocabulary
    except ValueError as err:
        if "end-of-document" not in str(err):
            raise
        eod = None  # a tokenizer without an end-of-document token: generation stops at --max-new-tokens
    tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json" if Path(path).is_dir() else path))
    return (lambda text: tok.encode(text).ids), tok.decode, eod


def _model_config(config: GenerateConfig):
    from flashpar.models import LlamaConfig

    if config.init_from is not None:
        return LlamaConfig.from_hf(config.init_from)
    from flashpar.train.checkpoint import latest

    meta = json.loads((latest(Path(config.checkpoint), say=None) / "meta.json").read_text())
    return LlamaConfig(**meta["model"])


def check(config: GenerateConfig):
    """``(model config, prompts, decode, eos)``; ``ValueError`` / ``FileNotFoundError``: one line."""
    from flashpar import cp
    from flashpar.infer.generate import check_prompts
    from flashpar.infer.sampling import Sampling

    for name in ("tp", "cp", "max_new_tokens"):
        if getattr(config, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(config, name)}")
    if config.ulysses != 1:
        raise ValueError(f"--ulysses {config.ulysses}: generation splits the heads over --tp only (ulysses 1)")
    if config.strategy not in cp.STRATEGIES:
        raise ValueError(f"--strategy {config.strategy!r}: expected one of {', '.join(cp.STRATEGIES)}")
    Sampling(config.temperature, config.top_k, config.top_p, config.seed)
    cfg = _model_config(config)
    for name in ("heads", "kv_heads", "ffn", "vocab_size"):
        if getattr(cfg, name) % config.tp:
            raise ValueError(f"--tp {config.tp}: the model's {name} = {getattr(cfg, name)} is not divisible by it")
    encode, decode, eod = _tokenizer(config, cfg.vocab_size)
    prompts = read_prompts(config.prompts, encode)
    check_prompts([p.tokens for p in prompts], cfg, config.max_new_tokens)
    eos = config.eos_id if config.eos_id is not None else eod
    return cfg, prompts, decode, eos


def rank_main(config: GenerateConfig) -> None:
    """One rank: build the mesh and model, load the weights, generate; rank 0 writes ``--out`` and the timings."""
    import datetime

    import torch
    import torch.distributed as dist

    from flashpar.dims import ParallelDims
    from flashpar.infer.generate import generate
    from flashpar.infer.sampling import Sampling
    from flashpar.models.parallel import ParallelLlama

    cfg, prompts, decode, eos = check(config)  # every rank reads the same files: the same line on every rank
    cuda = config.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=config.timeout))
    if dist.get_world_size() != config.tp * config.cp:
        raise ValueError(f"--tp {config.tp} x --cp {config.cp} = {config.tp * config.cp} ranks, the job has "
                         f"{dist.get_world_size()}")
    mesh = ParallelDims(1, config.cp, 1, config.tp).mesh(config.device)
    model = ParallelLlama(cfg, mesh, mode=config.mode, dp_mode="replicate", dtype=config.dtype,
                          timeout=config.timeout)
    if cuda:
        model = model.cuda()
    if config.init_from is not None:
        model.load_hf_slices(config.init_from)
    else:
        from flashpar.train.export import read_model

        model.load_full(read_model(config.checkpoint))
    rank0 = dist.get_rank() == 0
    how = Sampling(config.temperature, config.top_k, config.top_p, config.seed)
    out = generate(model, [p.tokens for p in prompts], max_new_tokens=config.max_new_tokens, sampling=how,
                   eos_id=eos, strategy=config.strategy, progress=config.progress and rank0)
    kv = torch.tensor([out.kv_bytes], dtype=torch.long)
    all_kv = [torch.zeros_like(kv) for _ in range(dist.get_world_size())]
    dist.all_gather(all_kv, kv, group=model.step_check.info.group)
    if rank0:
        _write(config, prompts, out, decode)
        per_rank = [int(t) for t in all_kv]
        print(f"time to first token {out.ttft_s * 1e3:.1f} ms; prefill {out.prefill_tokens_per_s:,.0f} tokens/s "
              f"({sum(out.prompt_tokens)} tokens); decode {out.decode_tokens_per_s:,.1f} tokens/s "
              f"({len(prompts)} prompts x {out.decode_steps} steps)")
        print(f"K/V cache per rank: max {max(per_rank) / 2**10:,.1f} KiB, all ranks {sum(per_rank) / 2**10:,.1f} KiB")
    dist.destroy_process_group()


def _write(config: GenerateConfig, prompts: list[Prompt], out, decode) -> None:
    lines = []
    for i, (prompt, tokens) in enumerate(zip(prompts, out.tokens, strict=True)):
        row = {"id": i, "prompt_tokens": len(prompt.tokens), "tokens": tokens}
        if decode is not None:
            row["text"] = decode(tokens)
        lines.append(json.dumps(row))
    if config.out is not None:
        Path(config.out).write_text("\n".join(lines) + "\n")
    else:
        print("\n".join(lines))


def _spawned(rank: int, world: int, rendezvous: dict, config: GenerateConfig, inherit, line) -> None:
    inherit.apply()
    line.watch()  # this rank ends when the launcher does, however it ends (flashpar.lifeline)
    os.environ.update(rendezvous, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        rank_main(config)
    except (ValueError, RuntimeError, FileNotFoundError) as err:
        print(f"{NAME}: rank {rank}: {str(err).strip().splitlines()[0]}", file=sys.stderr, flush=True)
        os._exit(FAILED)


def from_args(args: argparse.Namespace) -> GenerateConfig:
    fields = {k: v for k, v in vars(args).items() if k in GenerateConfig.__dataclass_fields__}
    return GenerateConfig(**fields)


def run(args: argparse.Namespace) -> int:
    config = from_args(args)
    try:
        check(config)
        if config.out is not None and not Path(config.out).parent.is_dir():
            raise ValueError(f"--out {config.out}: its folder does not exist")
        if config.device == "cuda" and "RANK" not in os.environ:
            raise ValueError("--device cuda runs under torchrun (one process per GPU)")
    except (ValueError, FileNotFoundError) as err:
        print(f"{NAME}: {err}", file=sys.stderr)
        return 2
    if "RANK" in os.environ:
        try:
            rank_main(config)
        except (ValueError, RuntimeError) as err:
            print(f"{NAME}: rank {os.environ['RANK']}: {str(err).strip().splitlines()[0]}", file=sys.stderr)
            return 1
        return 0
    import torch.multiprocessing as mp

    from flashpar import ranks
    from flashpar.lifeline import Lifeline

    world = config.tp * config.cp
    rendezvous = ranks.Rendezvous(config.master_addr, config.timeout)
    line = Lifeline()  # the ranks end when this process does, however it ends
    try:
        ranks.context()
        procs = mp.start_processes(_spawned, args=(world, rendezvous.env(), config, ranks.Inherit(), line.child()),
                                   nprocs=world, join=False, start_method=ranks.start_method())
        while not procs.join():
            pass
    except mp.ProcessExitedException as err:
        print(f"{NAME}: stopped: rank {err.error_index} exited with status {err.exit_code}", file=sys.stderr)
        return 1
    finally:
        rendezvous.close()
        line.close()
    return 0

"""``flashpar generate``: prefill a batch of prompts packed over a (tp, cp) mesh and decode them.

    flashpar generate --init-from HF_FOLDER --prompts FILE --tp T --cp C --max-new-tokens N --out OUT.jsonl
    flashpar generate --checkpoint DIR ...          (a flashpar training checkpoint, or a run's checkpoints/)

``FILE``: ``.jsonl`` with ``text``, ``tokens`` or (``--chat``) ``messages``, ``.txt`` (one prompt a line), or
``-`` (stdin, as ``.jsonl``): ``flashpar.infer.prompts``.  The tokenizer: ``--tokenizer``, else the folder's
``tokenizer.json``, else the one the checkpoint's run recorded (its meta.json ``sources``; a run on bytes: UTF-8
bytes).  ``OUT``: one line per output in input order, ``{"id", "prompt_tokens", "tokens", "text",
"finish_reason"}`` (``text`` where a tokenizer is known; ``index`` with ``--n`` > 1; ``logprobs`` with
``--logprobs``).  Without a launcher it spawns ``T x C`` CPU processes on gloo; under ``torchrun`` (``RANK`` set)
each process is one rank (``--device cuda``: NCCL).  The arguments, the model's config and the prompts are
checked before any process starts (one line, exit 2); a rank that fails prints one line naming itself.  Rank 0
prints the time to first token, prefill tokens/s and decode tokens/s at the end.

This module's top level imports the standard library only: ``flashpar generate --help`` does not import torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

NAME = "flashpar generate"
FAILED = 2  # a rank's exit status after printing its line


@dataclass(frozen=True)
class GenerateConfig:
    prompts: str
    init_from: str | None = None
    checkpoint: str | None = None
    tokenizer: str | None = None
    chat: bool = False
    tp: int = 1
    cp: int = 1
    ulysses: int = 1
    max_new_tokens: int = 32
    out: str | None = None
    temperature: float | None = None  # None: 1 where a sampling setting is given, else greedy
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int = 1
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    eos_id: int | None = None
    stop: tuple[str, ...] = ()
    stop_id: tuple[int, ...] = ()
    logprobs: bool = False
    strategy: str = "flashcp"
    mode: str = "auto"
    dtype: str = "fp32"
    compile: bool = False
    device: str = "cpu"
    timeout: float = 300.0
    master_addr: str = "127.0.0.1"
    progress: bool = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--init-from", metavar="FOLDER", help="a Hugging Face Llama folder (config.json, safetensors)")
    src.add_argument("--checkpoint", metavar="DIR",
                     help="a flashpar training checkpoint (or a run's checkpoints/ folder: its newest)")
    p.add_argument("--prompts", required=True, metavar="FILE",
                   help=".jsonl (one object a line: 'text', 'tokens', or 'messages' with --chat), .txt (one prompt a "
                        "line), or - (stdin, read as .jsonl)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="a tokenizer.json or its folder (default: the --init-from folder's, else the one the "
                        "--checkpoint's run recorded)")
    p.add_argument("--chat", action="store_true",
                   help="prompts are conversations, rendered by the tokenizer's chat template with the assistant's "
                        "turn opened (default: off)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: split the heads (default: 1)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks: split the packed prompts (default: 1)")
    p.add_argument("--ulysses", type=int, default=1, help="must be 1: decode splits heads over --tp (default: 1)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per output at most (default: 32)")
    p.add_argument("--out", metavar="FILE", help="write one JSON line per output here (default: stdout)")
    g = p.add_argument_group("sampling (greedy unless --temperature > 0 or a sampling-only flag is given)")
    g.add_argument("--temperature", type=float,
                   help="divides the logits; 0: greedy (default: 0, or 1 where --top-k, --top-p, --min-p, --seed or "
                        "--n > 1 is given)")
    g.add_argument("--top-k", type=int, help="sample among the k most likely tokens; 0: all (default: 0)")
    g.add_argument("--top-p", type=float,
                   help="sample among the fewest most likely tokens whose probability sums to >= p (default: 1)")
    g.add_argument("--min-p", type=float,
                   help="drop tokens less likely than min_p times the most likely one, in [0, 1] (default: 0)")
    g.add_argument("--seed", type=int, help="of the uniform numbers sampling draws: the same tokens on any mesh "
                                            "(default: 0)")
    g.add_argument("--n", type=int, default=1, help="outputs per prompt, each sampled with its own numbers "
                                                    "(default: 1)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divides positive (multiplies negative) logits of tokens in the prompt or output; > 0, 1: "
                        "none (default: 1)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted once from the logit of each token in the output, in [-2, 2] (default: 0)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted from a token's logit per time it is in the output, in [-2, 2] (default: 0)")
    s = p.add_argument_group("stopping and output")
    s.add_argument("--eos-id", type=int,
                   help="the end-of-text token (default: the tokenizer's, or the --checkpoint run's end of document)")
    s.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end an output where its text holds TEXT, cut before it; repeatable (default: none)")
    s.add_argument("--stop-id", action="append", default=[], type=int, metavar="ID",
                   help="end an output at this token, kept as its last; repeatable (default: none)")
    s.add_argument("--logprobs", action="store_true",
                   help="write each token's log-probability after the penalties and temperature (default: off)")
    r = p.add_argument_group("how it runs")
    r.add_argument("--strategy", default="flashcp", help="the context-parallel plan of the prefill (default: "
                                                         "flashcp)")
    r.add_argument("--mode", default="auto", help="FlashOverlap's mode of the prefill's tensor-parallel linears: "
                                                  "flash, ring, slice, none or auto (default: auto)")
    r.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="compute dtype (default: fp32)")
    r.add_argument("--compile", action="store_true",
                   help="compile the prefill's elementwise work (norms, rope, SwiGLU, residual adds) with "
                        "torch.compile at start-up; the communicating ops and decode stay eager (default: off)")
    r.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: one process per GPU, each started by a launcher that sets RANK (default: cpu)")
    r.add_argument("--timeout", type=float, default=300.0, help="seconds any distributed wait may take (default: "
                                                                "300)")
    r.add_argument("--master-addr", default="127.0.0.1", help="the spawned ranks' rendezvous address (default: "
                                                              "127.0.0.1)")
    r.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar over the decode steps (default: a bar on rank 0)")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Text:
    """How text becomes tokens and back: ``tokenizer`` (a tokenizer.json), or UTF-8 ``bytes`` (a run on bytes),
    or neither (token prompts only, no text in the output)."""

    tokenizer: str | None = None
    bytes: bool = False
    gone: str | None = None  # the line saying the run's recorded tokenizer is no longer there

    def codec(self, vocab_size: int | None = None):
        """``(encode, decode, tokenizer)`` (Nones where there is no text; with ``gone``, an encode that raises
        it)."""
        if self.gone is not None:
            def encode(text):
                raise ValueError(f"{self.gone}: give --tokenizer")
            return encode, None, None
        if self.tokenizer is not None:
            from flashpar.infer.tokenizer import load

            tok = load(self.tokenizer, vocab_size)
            return tok.encode, tok.decode, tok
        if self.bytes:
            return (lambda text: list(text.encode("utf-8"))), _bytes_text, None
        return None, None, None


def _bytes_text(ids: list[int]) -> str:
    return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Job:
    """What ``check`` found: the model's config, the prompts (token ids), the text, the sampling and stopping
    settings, and the lines to say before the ranks start."""

    cfg: object
    prompts: list
    text: Text
    sampling: object
    stopping: object
    notes: list[str] = field(default_factory=list)


def _own_tokenizer(config: GenerateConfig, vocab_size: int) -> tuple[str | None, int | None, bool, str | None]:
    """The model's own tokenizer.json (the folder's, or the one its run recorded), the run's end-of-document id,
    whether the run was on bytes, and a line where the run recorded a tokenizer that is no longer there."""
    if config.init_from is not None:
        own = Path(config.init_from) / "tokenizer.json"
        return (str(own) if own.is_file() else None), None, False, None
    from flashpar.train.checkpoint import latest
    from flashpar.train.handoff import sources_of

    ckpt = latest(Path(config.checkpoint), say=None)
    meta = json.loads((ckpt / "meta.json").read_text())
    recorded = sources_of(ckpt).get("tokenizer")
    if recorded is None:  # a run on bytes records no tokenizer (and its model has the 256 byte ids)
        return None, None, "sources" in meta and vocab_size >= 256, None
    if Path(recorded).is_file():
        return recorded, sources_of(ckpt).get("eod"), False, None
    return None, None, False, f"the run's tokenizer {recorded} (recorded in {ckpt / 'meta.json'}) no longer exists"


def _text(config: GenerateConfig, vocab_size: int, notes: list[str]) -> tuple[Text, int | None]:
    """The text of the job and the run's end-of-document id (where its own tokenizer is used)."""
    own, eod, on_bytes, gone = _own_tokenizer(config, vocab_size)
    if config.tokenizer is None:
        return Text(own, on_bytes and own is None, gone), eod
    from flashpar.tokenizer_files import tokenizer_json

    given = tokenizer_json(config.tokenizer)
    if own is not None and Path(own).resolve() != given.resolve() and Path(own).read_bytes() != given.read_bytes():
        notes.append(f"--tokenizer {config.tokenizer}: not the model's own tokenizer.json ({own}); its ids are read as "
                     "that one's")
    return Text(str(given)), None


def _model_config(config: GenerateConfig):
    from flashpar.models import LlamaConfig

    if config.init_from is not None:
        return LlamaConfig.from_hf(config.init_from)
    from flashpar.train.checkpoint import latest

    meta = json.loads((latest(Path(config.checkpoint), say=None) / "meta.json").read_text())
    return LlamaConfig(**meta["model"])


def _sampling(config: GenerateConfig):
    from flashpar.infer.sampling import Sampling, SamplingError

    given = {name: getattr(config, name) for name in ("temperature", "top_k", "top_p", "min_p", "seed")
             if getattr(config, name) is not None}
    try:
        return Sampling(**given, n=config.n, repetition_penalty=config.repetition_penalty,
                        presence_penalty=config.presence_penalty, frequency_penalty=config.frequency_penalty)
    except SamplingError as err:
        raise ValueError(f"{flag(err.name)} {err.rule.replace('temperature', '--temperature')}") from None


def check(config: GenerateConfig) -> Job:
    """The job ``config`` describes; ``ValueError`` / ``FileNotFoundError``: one line."""
    from flashpar import cp
    from flashpar.infer.generate import check_prompts
    from flashpar.infer.prompts import read_prompts
    from flashpar.infer.stopping import Stopping
    from flashpar.options import MODES

    for name in ("tp", "cp", "max_new_tokens"):
        if getattr(config, name) < 1:
            raise ValueError(f"{flag(name)} must be >= 1, got {getattr(config, name)}")
    if config.ulysses != 1:
        raise ValueError(f"--ulysses {config.ulysses}: generation splits the heads over --tp only (ulysses 1)")
    if config.strategy not in cp.STRATEGIES:
        raise ValueError(f"--strategy {config.strategy!r}: expected one of {', '.join(cp.STRATEGIES)}")
    if config.mode not in MODES:
        raise ValueError(f"--mode {config.mode!r}: expected one of {', '.join(MODES)}")
    if not config.timeout > 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {config.timeout}")
    if config.prompts == "-" and "RANK" in os.environ:
        raise ValueError("--prompts - (stdin) is read by the launcher that spawns the ranks: under torchrun give a "
                         "file")
    for s in config.stop:
        if not s:
            raise ValueError("--stop '': a stop string must not be empty")
    how = _sampling(config)
    notes = [line] if (line := how.note(flag)) else []
    cfg = _model_config(config)
    for name in ("heads", "kv_heads", "ffn"):  # any vocabulary: the model pads its rows to a multiple of tp
        if getattr(cfg, name) % config.tp:
            raise ValueError(f"--tp {config.tp}: the model's {name} = {getattr(cfg, name)} is not divisible by it")
    ids = [("--eos-id", config.eos_id)] if config.eos_id is not None else []
    for name, t in ids + [("--stop-id", t) for t in config.stop_id]:
        if not 0 <= t < cfg.vocab_size:
            raise ValueError(f"{name} {t}: not a token id of the model's vocabulary [0, {cfg.vocab_size})")
    text, run_eod = _text(config, cfg.vocab_size, notes)
    if text.gone is not None and (config.stop or config.chat):
        raise ValueError(f"{text.gone}: give --tokenizer")
    encode, decode, tok = text.codec(cfg.vocab_size)
    if config.stop and decode is None:
        raise ValueError("--stop needs a tokenizer to read the output's text (--tokenizer); --stop-id stops at a "
                         "token id")
    chat = None
    if config.chat:
        if tok is None:
            raise ValueError("--chat needs a tokenizer with a chat template (--tokenizer)")
        chat = tok.check_chat().chat
    prompts = read_prompts(config.prompts, encode, chat)
    if text.gone is not None:  # token prompts only: what is lost is the output's text
        notes.append(f"{text.gone}: the output has no text (give --tokenizer for it)")
    check_prompts([p.tokens for p in prompts], cfg, config.max_new_tokens)
    eos = config.eos_id if config.eos_id is not None else run_eod if run_eod is not None else (
        tok.eos if tok is not None else None)
    stopping = Stopping(eos, tuple(config.stop_id), tuple(config.stop))
    return Job(cfg, prompts, text, how, stopping, notes)


def rank_main(config: GenerateConfig, job: Job) -> None:
    """One rank: build the mesh and model, load the weights, generate; rank 0 writes ``--out`` and the timings."""
    import datetime

    import torch
    import torch.distributed as dist

    from flashpar.dims import ParallelDims
    from flashpar.infer.generate import generate
    from flashpar.mesh import init_world
    from flashpar.models.compiling import warm_up
    from flashpar.models.parallel import ParallelLlama

    cfg = job.cfg
    _, decode, _ = job.text.codec()
    cuda = config.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    init_world("nccl" if cuda else "gloo", datetime.timedelta(seconds=config.timeout))
    if dist.get_world_size() != config.tp * config.cp:
        raise ValueError(f"--tp {config.tp} x --cp {config.cp} = {config.tp * config.cp} ranks, the job has "
                         f"{dist.get_world_size()}")
    mesh = ParallelDims(1, config.cp, 1, config.tp).mesh(config.device)
    model = ParallelLlama(cfg, mesh, mode=config.mode, dp_mode="replicate", dtype=config.dtype,
                          compile=config.compile, timeout=config.timeout)
    if cuda:
        model = model.cuda()
    if config.init_from is not None:
        model.load_hf_slices(config.init_from)
    else:
        from flashpar.train.export import read_model

        model.load_full(read_model(config.checkpoint))
    rank0 = dist.get_rank() == 0
    compiled = warm_up(model, grad=False)  # --compile: the prefill's regions, before the clock starts
    if compiled is not None:
        compiled = compiled.slowest(model.norm.weight.device)
        if rank0:
            print(f"{NAME}: {compiled.line()}", file=sys.stderr, flush=True)
    st = job.stopping
    out = generate(model, [p.tokens for p in job.prompts], max_new_tokens=config.max_new_tokens,
                   sampling=job.sampling, eos_id=st.eos_id, stop_ids=st.stop_ids, stop=st.stop,
                   decode=decode, logprobs=config.logprobs, strategy=config.strategy,
                   progress=config.progress and rank0)
    kv = torch.tensor([out.kv_bytes], dtype=torch.long)
    all_kv = [torch.zeros_like(kv) for _ in range(dist.get_world_size())]
    dist.all_gather(all_kv, kv, group=model.step_check.info.group)
    if rank0:
        _write(config, job, out)
        per_rank = [int(t) for t in all_kv]
        print(f"time to first token {out.ttft_s * 1e3:.1f} ms; prefill {out.prefill_tokens_per_s:,.0f} tokens/s "
              f"({out.n * sum(out.prompt_tokens)} tokens); decode {out.decode_tokens_per_s:,.1f} tokens/s "
              f"({len(out.tokens)} outputs x {out.decode_steps} steps)")
        print(f"K/V cache per rank: max {max(per_rank) / 2**10:,.1f} KiB, all ranks {sum(per_rank) / 2**10:,.1f} KiB")
    dist.destroy_process_group()


def _write(config: GenerateConfig, job: Job, out) -> None:
    n, lines = out.n, []
    for k, tokens in enumerate(out.tokens):
        i = k // n
        row = {"id": i, **({"index": k % n} if n > 1 else {}), "prompt_tokens": len(job.prompts[i].tokens),
               "tokens": tokens}
        if out.texts is not None:
            row["text"] = out.texts[k]
        row["finish_reason"] = out.finish_reasons[k]
        if out.logprobs is not None:
            row["logprobs"] = out.logprobs[k]
        lines.append(json.dumps(row))
    if config.out is not None:
        Path(config.out).write_text("\n".join(lines) + "\n")
    else:
        print("\n".join(lines))


def _say(job: Job) -> None:
    for line in job.notes:
        print(f"{NAME}: {line}", file=sys.stderr, flush=True)


def _spawned(rank: int, world: int, rendezvous: dict, config: GenerateConfig, job: Job, inherit, line) -> None:
    inherit.apply()
    line.watch()  # this rank ends when the launcher does, however it ends (flashpar.lifeline)
    os.environ.update(rendezvous, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        rank_main(config, job)
    except (ValueError, RuntimeError, FileNotFoundError) as err:
        print(f"{NAME}: rank {rank}: {str(err).strip().splitlines()[0]}", file=sys.stderr, flush=True)
        os._exit(FAILED)


def from_args(args: argparse.Namespace) -> GenerateConfig:
    fields = {k: v for k, v in vars(args).items() if k in GenerateConfig.__dataclass_fields__}
    for name in ("stop", "stop_id"):
        fields[name] = tuple(fields.get(name) or ())
    return GenerateConfig(**fields)


def run(args: argparse.Namespace) -> int:
    config = from_args(args)
    try:
        job = check(config)  # under torchrun every rank reads the same files: the same line on every rank
        if config.out is not None and not Path(config.out).parent.is_dir():
            raise ValueError(f"--out {config.out}: its folder does not exist")
        if config.device == "cuda" and "RANK" not in os.environ:
            raise ValueError("--device cuda runs under torchrun (one process per GPU)")
    except (ValueError, FileNotFoundError) as err:
        print(f"{NAME}: {err}", file=sys.stderr)
        return 2
    if "RANK" in os.environ:
        if os.environ["RANK"] == "0":
            _say(job)
        try:
            rank_main(config, job)
        except (ValueError, RuntimeError) as err:
            print(f"{NAME}: rank {os.environ['RANK']}: {str(err).strip().splitlines()[0]}", file=sys.stderr)
            return 1
        return 0
    _say(job)
    import torch.multiprocessing as mp

    from flashpar import ranks
    from flashpar.lifeline import Lifeline

    world = config.tp * config.cp
    rendezvous = ranks.Rendezvous(config.master_addr, config.timeout)
    line = Lifeline()  # the ranks end when this process does, however it ends
    try:
        ranks.context()
        procs = mp.start_processes(_spawned, args=(world, rendezvous.env(), config, job, ranks.Inherit(),
                                                   line.child()),
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

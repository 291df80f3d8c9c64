"""The training runs that the trainer's end-to-end tests and the README-command test share.

A launch of ``flashpar train`` costs about 12 s on 2 cores before its first step (four ranks import
torch and its optimizer), so each run below is made once per test session and every test that needs
its output reads it: ``tests/test_train_cli.py`` (metrics, trace, plot, resume on the same and on other
meshes, ``--check``) and ``tests/test_readme_commands.py`` (the README's training commands).

The runs, in order, in one folder (the later runs resume the first one's checkpoint of step 2)::

    train                4 steps, checkpoints at 2 and 4, trace, plot   (README: train, --save-every, --trace --plot)
    resume-same          from step 2 with no other flag: the checkpoint's settings, steps 3, 4
    resume-ulysses       from step 2 on (1, 2, 2, 1): Ulysses inside cp  (README: --resume ... --ulysses 2 --tp 1)
    resume-per-doc-ring  from step 2 on (2, 2, 1), ZeRO-3, per_doc, ring (README: --dp 2 ... per_doc --mode ring)
    resume-compiled      from step 2 with --compile: the regions compiled at start-up, steps 3, 4 compiled
    check-compiled       --check --compile on the default mesh           (README: --compile)
    check-hf             --check on the sizes of a Hugging Face config   (README: --check, --hf-config)
    own-model            from a Hugging Face folder (weights, tokenizer) on jsonl / parquet / text documents,
                         micro-batches, warm-up + cosine, clipping, bf16, activation checkpointing, validation
                         loss, a checkpoint at step 4                     (README: "Train your own model")
    export               that checkpoint as a Hugging Face folder        (README: flashpar export)

The own-model inputs are made here, nothing downloaded: a random ``LlamaForCausalLM`` saved by
``transformers`` and a BPE ``tokenizer.json`` trained by ``tokenizers`` on standard-library sources, in
``path/to/llama``; documents in ``my_docs`` (``OWN_MODEL``).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from flashpar.cli import main
from flashpar.train.config import TrainConfig

# every run: a short corpus and sequence, plans made in the rank (no data-loader process to start)
TRAIN = ["--seq-len", "256", "--max-docs", "40", "--workers", "0"]
HF_CONFIG = {"vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 64}
STEP2 = "runs/train/checkpoints/step_2"
# the own-model run: a Llama 3.1-style folder (llama3 rope, untied), a 300-token BPE vocabulary in a 384-row model
OWN_MODEL = {"vocab_size": 384, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
             "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
             "tie_word_embeddings": False}
OWN_VOCAB = 300
EOD = "<|end_of_text|>"
RUNS = {  # name -> argv (run in this order, in the session's folder)
    "train": ["train", "--steps", "4", "--save-every", "2", "--trace", "--plot", *TRAIN],
    "resume-same": ["train", "--resume", STEP2, "--out", "runs/same"],  # every other setting: the checkpoint's
    "resume-ulysses": ["train", "--resume", STEP2, "--cp", "2", "--ulysses", "2", "--tp", "1", "--steps", "4",
                       "--out", "runs/ulysses", *TRAIN],
    "resume-per-doc-ring": ["train", "--resume", STEP2, "--dp", "2", "--cp", "2", "--tp", "1", "--strategy", "per_doc",
                            "--mode", "ring", "--steps", "4", "--out", "runs/resumed", *TRAIN],
    "resume-compiled": ["train", "--resume", STEP2, "--compile", "--out", "runs/compiled"],
    "check-compiled": ["train", "--check", "--compile", "--out", "runs/check-compiled", *TRAIN],
    "check-hf": ["train", "--check", "--hf-config", "path/to/config.json", "--out", "runs/check", *TRAIN],
    "own-model": ["train", "--init-from", "path/to/llama", "--tokenizer", "path/to/llama", "--data", "my_docs",
                  "--micro-batches", "2", "--warmup", "1", "--lr", "1e-3", "--lr-min", "1e-4", "--clip", "1.0",
                  "--dtype", "bf16", "--checkpoint-activations", "--eval-every", "2", "--eval-docs", "4",
                  "--save-every", "4", "--steps", "4", "--out", "runs/mine", *TRAIN],
    "export": ["export", "runs/mine/checkpoints", "--hf", "runs/mine/hf"],
}


@dataclass(frozen=True)
class Run:
    """One finished run: its exit status, what it printed, and its ``--out`` folder."""

    rc: int
    stdout: str
    stderr: str
    out: Path

    def losses(self) -> dict[int, float]:
        rows = map(json.loads, (self.out / "metrics.jsonl").read_text().splitlines())
        return {r["step"]: r["loss"] for r in rows}


def make_runs(root: Path) -> dict[str, Run]:
    """Every run of ``RUNS`` in ``root`` (the working directory while they run: the README's paths are
    relative); stdout and stderr of each go to files there (the launcher's ranks write to real file
    descriptors)."""
    (root / "path" / "to").mkdir(parents=True, exist_ok=True)
    (root / "path" / "to" / "config.json").write_text(json.dumps(HF_CONFIG))
    make_own_model_inputs(root)
    runs, cwd = {}, os.getcwd()
    os.chdir(root)
    try:
        for name, argv in RUNS.items():
            out_path, err_path = root / f"{name}.stdout", root / f"{name}.stderr"
            with open(out_path, "w") as out, open(err_path, "w") as err, \
                    contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = main(argv)
            flag = next((f for f in ("--out", "--hf") if f in argv), None)
            out_dir = argv[argv.index(flag) + 1] if flag else TrainConfig.out  # the run's --out (export: --hf)
            runs[name] = Run(rc, out_path.read_text(), err_path.read_text(), root / out_dir)
    finally:
        os.chdir(cwd)
    return runs


def make_own_model_inputs(root: Path) -> None:
    """``path/to/llama``: a random ``LlamaForCausalLM`` of ``OWN_MODEL`` saved by transformers, with a BPE
    ``tokenizer.json`` (``OWN_VOCAB`` tokens, ``EOD`` its end-of-document token) trained on 60 standard-library
    sources; ``my_docs``: 72 other sources as a.jsonl, b.parquet and notes/*.txt."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import tokenizers as tk
    import torch
    import transformers

    from flashpar import corpus

    small = [p for p in corpus.document_paths() if 1500 <= p.stat().st_size <= 8000][:132]
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in small]
    llama = root / "path" / "to" / "llama"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**OWN_MODEL, initializer_range=0.1))
    model.save_pretrained(llama)
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.train_from_iterator(texts[:60], tk.trainers.BpeTrainer(
        vocab_size=OWN_VOCAB, special_tokens=[EOD], show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(llama / "tokenizer.json"))
    docs = root / "my_docs"
    (docs / "notes").mkdir(parents=True)
    with open(docs / "a.jsonl", "w") as f:
        for text in texts[60:84]:
            f.write(json.dumps({"text": text}) + "\n")
    pq.write_table(pa.table({"text": texts[84:108]}), docs / "b.parquet")
    for i, text in enumerate(texts[108:]):
        (docs / "notes" / f"{i:02d}.txt").write_text(text)

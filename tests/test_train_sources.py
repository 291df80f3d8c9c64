"""``--data`` / ``--tokenizer`` / ``--eval-every``: the readers and their one-line errors, a BPE tokenizer trained
here on corpus documents, the token cache, packing with end-of-document tokens, the held-out split, and (one
spawn of 2 ranks) the validation loss against the single-process model and a few training steps on jsonl and
parquet data."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
from pathlib import Path

import pytest
import torch

from dist_harness import run_ranks
from flashpar import corpus
from flashpar.models import LlamaConfig
from flashpar.train import checkpoint, sources, tokens
from flashpar.train.config import TrainConfig, add_arguments, from_args, ready
from flashpar.train.data import PlannedSequences, training_data
from sources_workers import sources_cases

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
tk = pytest.importorskip("tokenizers")

VOCAB = 320  # the BPE vocabulary trained here; the model's: 320 (divisible by tp 2)
MODEL = LlamaConfig(vocab_size=VOCAB, hidden=32, layers=1, heads=4, kv_heads=2, ffn=64)
SEQ = 256


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """36 short standard-library sources (1-6 KB), as text."""
    small = [p for p in corpus.document_paths() if 1000 <= p.stat().st_size <= 6000][:36]
    return [p.read_text(encoding="utf-8", errors="replace") for p in small]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, texts) -> Path:
    """``tokenizer.json`` (BPE, 320 tokens, trained on ``texts``) and the data: a.jsonl (12 documents),
    b.parquet (12), docs/x.txt, docs/sub/y.md, docs/z.jsonl (the other 12) and docs/skip.bin (ignored)."""
    root = tmp_path_factory.mktemp("sources")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tk.trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(root / "tokenizer.json"))
    _jsonl(root / "a.jsonl", texts[:12])
    pq.write_table(pa.table({"text": texts[12:24], "n": list(range(12))}), root / "b.parquet")
    (root / "docs" / "sub").mkdir(parents=True)
    (root / "docs" / "x.txt").write_text(texts[24])
    (root / "docs" / "sub" / "y.md").write_text(texts[25])
    _jsonl(root / "docs" / "z.jsonl", texts[26:])
    (root / "docs" / "skip.bin").write_bytes(b"\xff\x00")
    return root


def _jsonl(path: Path, docs) -> None:
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))


def _config(folder: Path, out: Path, **kw) -> TrainConfig:
    base = {"nproc": 1, "dp": 1, "cp": 1, "tp": 1, "seq_len": SEQ, "model": MODEL, "workers": 0, "out": str(out),
            "tokenizer": str(folder / "tokenizer.json"), "data": [str(folder / "a.jsonl"), str(folder / "b.parquet"),
                                                                  str(folder / "docs")], "seed": 5, "timeout": 60.0}
    return TrainConfig(**{**base, **kw})


def _direct(folder: Path, texts, order) -> list[list[int]]:
    """Every document tokenized directly (no cache), in source order, then ``order``ed: ids + end of document."""
    tok = tk.Tokenizer.from_file(str(folder / "tokenizer.json"))
    eod = tok.token_to_id("<|endoftext|>")
    docs = [tok.encode(t).ids + [eod] for t in texts]
    return [docs[k] for k in order]


# ---- readers -------------------------------------------------------------------------------------------------


def test_readers_give_every_document_in_order_and_folders_recursively_sorted(folder, texts):
    files = sources.expand([folder / "a.jsonl", folder / "b.parquet", folder / "docs"])
    assert [name for _, name in files] == ["a.jsonl", "b.parquet", "sub/y.md", "x.txt", "z.jsonl"]  # skip.bin: not
    got = list(sources.documents([folder / "a.jsonl", folder / "b.parquet", folder / "docs"]))
    assert got == texts[:24] + [texts[25], texts[24]] + texts[26:]
    assert list(sources.documents([folder / "a.jsonl"], limit=3)) == texts[:3]
    # the identity: names and sizes (not where the files lie), in order
    assert sources.identity([folder / "a.jsonl"]) != sources.identity([folder / "b.parquet"])
    assert sources.identity([folder / "docs"]) == sources.identity([str(folder / "docs")])


def _bad_inputs(root: Path) -> list[tuple[list, str]]:
    def jsonl(name, body):
        (root / name).write_text(body)
        return [root / name]

    pq.write_table(pa.table({"body": ["x"]}), root / "nocol.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), root / "ints.parquet")
    pq.write_table(pa.table({"text": ["a", None]}), root / "null.parquet")
    (root / "junk.parquet").write_text("not parquet")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "empty").mkdir()
    (root / "empty.txt").write_text("")
    (root / "notes.csv").write_text("a,b")
    return [
        ([root / "missing.jsonl"], "missing.jsonl: no such file or folder"),
        ([root / "notes.csv"], "notes.csv: unknown extension '.csv'"),
        (jsonl("bad.jsonl", '{"text": "a"}\n\n{oops\n'), r"bad.jsonl line 3: not JSON"),
        (jsonl("notext.jsonl", '{"text": "a"}\n{"body": "b"}\n'), "notext.jsonl line 2: no string field 'text'"),
        (jsonl("num.jsonl", '{"text": 7}\n'), "num.jsonl line 1: no string field 'text'"),
        (jsonl("list.jsonl", '["text"]\n'), "list.jsonl line 1: no string field 'text'"),
        ([root / "nocol.parquet"], r"nocol.parquet: no column 'text' \(columns: body\)"),
        ([root / "ints.parquet"], "ints.parquet: column 'text' holds int64, not strings"),
        ([root / "null.parquet"], "null.parquet row 1: 'text' is null"),
        ([root / "junk.parquet"], "junk.parquet: not a parquet file"),
        ([root / "latin1.txt"], r"latin1.txt: not UTF-8 text \(byte 3\)"),
        ([root / "empty", root / "empty.txt"], "no documents"),
    ]


def test_each_bad_input_is_one_line_naming_the_file(tmp_path):
    for paths, words in _bad_inputs(tmp_path):
        with pytest.raises(ValueError, match=words) as err:
            list(sources.documents(paths))
        assert "\n" not in str(err.value), str(err.value)


def test_parquet_without_pyarrow_is_one_line(tmp_path, monkeypatch, folder):
    import builtins

    real = builtins.__import__

    def no_pyarrow(name, *args, **kw):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(ValueError, match=r"b.parquet: reading .parquet needs pyarrow \(pip install 'flashpar\[data"):
        list(sources.documents([folder / "b.parquet"]))


# ---- the tokenizer -------------------------------------------------------------------------------------------


def test_the_tokenizer_must_fit_the_model_and_have_an_end_of_document_token(folder, tmp_path):
    path = folder / "tokenizer.json"
    tok = tokens.load_tokenizer(path, vocab_size=VOCAB)
    assert (tok.vocab, tok.max_id, tok.eod_token) == (VOCAB, VOCAB - 1, "<|endoftext|>")
    assert tok.eod == tk.Tokenizer.from_file(str(path)).token_to_id("<|endoftext|>")
    assert tokens.load_tokenizer(folder).sha256 == tok.sha256  # the folder holding tokenizer.json
    with pytest.raises(ValueError, match=r"its vocabulary \(320 tokens, largest id 319\) does not fit the model's "
                                         r"vocab_size 256; use --vocab-size 320 or more"):
        tokens.load_tokenizer(path, vocab_size=256, fix=tokens.vocabulary_fix(_config(folder, tmp_path)))
    with pytest.raises(ValueError, match=r"--eod-token '<eos>' is not in the vocabulary"):
        tokens.load_tokenizer(path, "<eos>")
    # another name for the end of a document: from tokenizer_config.json beside it, or none at all
    other = json.loads(path.read_text())
    other["added_tokens"][0]["content"] = "<|end|>"
    other["model"]["vocab"]["<|end|>"] = other["model"]["vocab"].pop("<|endoftext|>")
    (tmp_path / "tokenizer.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match=r"none of the end-of-document tokens <\|end_of_text\|>, <\|endoftext\|>, "
                                         r"</s>, <eos> is in its vocabulary; name one with --eod-token"):
        tokens.load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|end|>"}}))
    assert tokens.load_tokenizer(tmp_path).eod_token == "<|end|>"
    assert tokens.load_tokenizer(tmp_path, "<|end|>").eod == tok.eod
    (tmp_path / "bad" / "tokenizer.json").parent.mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{}")
    for bad, words in ((tmp_path / "bad", "not a Hugging Face tokenizer.json"), (tmp_path / "none", "no tokenizer")):
        with pytest.raises(ValueError, match=words) as err:
            tokens.load_tokenizer(bad)
        assert "\n" not in str(err.value)


# ---- the token cache and the packing -------------------------------------------------------------------------


def test_packing_with_a_tokenizer_is_the_directly_tokenized_stream_with_eod_and_labels(folder, texts, tmp_path):
    config = _config(folder, tmp_path)
    ds = training_data(config)
    shuffled = list(range(len(texts)))
    random.Random(5).shuffle(shuffled)  # the seed's document order
    assert ds.order == shuffled
    source_order = texts[:24] + [texts[25], texts[24]] + texts[26:]
    docs = _direct(folder, source_order, ds.order)
    stream = torch.tensor([t for d in docs for t in d])
    labels = torch.tensor([t for d in docs for t in d[1:] + [-100]])
    items = [ds[i] for i in range(len(ds))]
    assert len(ds) == stream.numel() // SEQ > 10
    assert torch.equal(torch.cat([it["tokens"] for it in items]), stream[: len(ds) * SEQ])
    assert torch.equal(torch.cat([it["labels"] for it in items]), labels[: len(ds) * SEQ])
    eod = tokens.load_tokenizer(config.tokenizer).eod
    got = torch.cat([it["tokens"] for it in items])
    # every document ends with the end-of-document token, which has no target; ids stay in the vocabulary
    assert torch.equal((torch.cat([it["labels"] for it in items]) == -100).nonzero(), (got == eod).nonzero())
    assert int(got.max()) < VOCAB and int(got.min()) >= 0
    # dp shares and the resume start read the same items
    dp, k = 3, 2
    ranks = [PlannedSequences(ds, 1, "contiguous", dp_rank=r, dp_size=dp) for r in range(dp)]
    assert sorted(ranks[r].global_index(j) for r in range(dp) for j in range(len(ranks[r]))) == list(range(len(ds)))
    for r in range(dp):
        resumed = PlannedSequences(ds, 1, "contiguous", dp_rank=r, dp_size=dp, start=k * dp)
        assert torch.equal(resumed[0]["tokens"], ranks[r][k]["tokens"]) and resumed[0]["index"] == k * dp + r


def test_the_cache_is_built_once_by_a_pool_the_same_as_in_process_and_keyed_by_its_sources(folder, tmp_path,
                                                                                           monkeypatch):
    monkeypatch.setattr(tokens, "BATCH_CHARS", 20_000)  # ~8 batches: more than the pool's 4 in flight
    here = tokens.prepare(_config(folder, tmp_path / "here"))
    pool = tokens.prepare(_config(folder, tmp_path / "pool", workers=2))
    assert (here / "tokens.bin").read_bytes() == (pool / "tokens.bin").read_bytes()
    index = json.loads((here / "index.json").read_text())
    assert index["dtype"] == "uint16" and len(index["lengths"]) == 36
    assert [s[0] for s in index["sources"]][:2] == [str((folder / n).resolve()) for n in ("a.jsonl", "b.parquet")]
    stamp = (here / "index.json").stat().st_mtime_ns
    assert tokens.prepare(_config(folder, tmp_path / "here")) == here  # found: not rebuilt
    assert (here / "index.json").stat().st_mtime_ns == stamp
    assert tokens.prepare(_config(folder, tmp_path / "here", max_docs=5)) != here  # other documents, other cache
    # a rank that waits for another to build: one line after --timeout
    config = _config(folder, tmp_path / "nobody", timeout=0.3)
    with pytest.raises(ValueError, match=r"waited 0 s \(--timeout\) for the token cache .* that local rank 0 builds"):
        tokens.prepare(config, wait=True)
    # without --tokenizer, --data is the files' UTF-8 bytes
    raw = training_data(_config(folder, tmp_path / "bytes", tokenizer=None, model=dataclasses.replace(MODEL,
                                                                                                      vocab_size=256)))
    assert raw.tokens.dtype == "uint8" and sum(raw.tokens.lengths) == sum(
        len(t.encode()) for t in sources.documents([folder / "a.jsonl", folder / "b.parquet", folder / "docs"]))


def test_a_resume_on_other_data_or_tokenizer_is_refused_in_one_line(folder, tmp_path):
    config = _config(folder, tmp_path)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "meta.json").write_text(json.dumps({"step": 1, "sequences": 1, **config.kept()}))
    assert checkpoint.read_meta(tmp_path / "ck", config)["step"] == 1
    for other, what in ((dataclasses.replace(config, data=(str(folder / "a.jsonl"),)), "--data"),
                        (dataclasses.replace(config, tokenizer=None), "--tokenizer / --eod-token"),
                        (dataclasses.replace(config, eval_every=3), "--eval-every / --eval-docs")):
        with pytest.raises(ValueError, match=f"was made with other settings: {what} ") as err:
            checkpoint.read_meta(tmp_path / "ck", other)
        assert "\n" not in str(err.value)


def test_held_out_documents_are_disjoint_from_training_and_fixed_by_the_seed(folder, tmp_path):
    config = _config(folder, tmp_path, eval_every=2, eval_docs=5)
    train, held = training_data(config), training_data(config, "eval")
    everything = training_data(dataclasses.replace(config, eval_every=0))
    assert len(held.order) == 5 and not set(train.order) & set(held.order)
    assert sorted(train.order + held.order) == list(range(36)) and train.order + held.order == everything.order
    # training is the stream without them: the same sequences, cut before the held-out documents
    assert len(train) < len(everything) and torch.equal(train[len(train) - 1]["tokens"],
                                                        everything[len(train) - 1]["tokens"])
    again, other = training_data(config, "eval"), training_data(dataclasses.replace(config, seed=6), "eval")
    assert again.order == held.order and other.order != held.order
    # the held-out stream is those documents' tokens
    stream = torch.cat([torch.from_numpy(held.tokens.document(k).astype("int64")) for k in held.order])
    assert torch.equal(torch.cat([held[i]["tokens"] for i in range(len(held))]), stream[: len(held) * SEQ])


def test_flags_and_ready_checks(folder, tmp_path):
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--tokenizer", "t.json", "--data", "a.jsonl", "dir", "--eval-every", "4", "--eval-docs", "3",
                         "--vocab-size", "512", "--eod-token", "</s>"])
    config = from_args(args)
    assert (config.tokenizer, config.data, config.eval_every, config.eval_docs, config.eod_token,
            config.model.vocab_size) == ("t.json", ("a.jsonl", "dir"), 4, 3, "</s>", 512)
    assert from_args(p.parse_args([])).data is None
    cases = [
        ({"tokenizer": None, "data": None, "model": dataclasses.replace(MODEL, vocab_size=200)},
         "the byte tokens (0-255) do not fit the model's vocab_size 200"),
        ({"model": dataclasses.replace(MODEL, vocab_size=300)}, "does not fit the model's vocab_size 300"),
        ({"data": [str(tmp_path / "nope")]}, "nope: no such file or folder"),
        ({"eval_every": 1, "eval_docs": 1, "seq_len": 4096}, "held-out documents"),
        ({"eval_every": 1, "eval_docs": 36}, "leaves training documents: there are 36 documents"),
        ({"seq_len": 32768, "dp": 8, "nproc": 8}, "fewer than one global batch"),
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": null}\n')
    cases.append(({"data": [str(folder / "a.jsonl"), str(bad)], "workers": 1}, "bad.jsonl line 2: no string field"))
    for kw, words in cases:
        with pytest.raises(ValueError) as err:
            ready(_config(folder, tmp_path, **kw), kw.get("nproc", 1))
        assert words in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not list((tmp_path / "tokens").glob("*/*.tmp"))  # a failed build leaves no partial file
    left = [d.name for d in (tmp_path / "tokens").glob("*") if not (d / "index.json").is_file()]
    assert not left, left  # nor a cache folder without its index
    with pytest.raises(ValueError, match="eval-docs must be an integer >= 1"):
        _config(folder, tmp_path, eval_docs=0)
    assert ready(_config(folder, tmp_path, eval_every=2), 1).data == _config(folder, tmp_path).data


# ---- one spawn of 2 ranks: the validation loss on three meshes, and a few training steps -----------------------


SHAPES = [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 1, 2)]  # dp (ZeRO-3), cp, tp


@pytest.fixture(scope="module")
def spawned(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    # 2 held-out documents of 256-token sequences: 9 sequences (few forwards: most of a spawn's time here)
    evaluation = _config(folder, out / "eval", eval_every=1, eval_docs=2)
    training = _config(folder, out / "train", nproc=2, dp=2, steps=3, eval_every=2, eval_docs=2,
                       data=[str(folder / "a.jsonl"), str(folder / "b.parquet")])
    untouched = dataclasses.replace(training, eval_every=0, out=str(out / "no-eval"))  # the same steps, no eval
    for config in (evaluation, training, untouched):
        ready(config, config.world_size)  # the launcher's check: builds the token cache
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    per_rank = run_ranks(2, sources_cases, evaluation, SHAPES, [training, untouched], timeout=240.0)
    return per_rank, out


def test_eval_loss_equals_the_single_process_models_loss_on_the_held_out_sequences(spawned):
    """The mesh model's forward (fp32) against the float64 single-process model of the same seeded weights on
    the same held-out sequences with one divisor: the fp32 forward of this tiny model (hidden 32, ~2000
    positions) agrees to ~1e-7 relative; 1e-5 leaves room and fails on one misplaced sequence or a wrong
    divisor (a change of O(1e-2) of a ~5.8-nat loss)."""
    per_rank, _ = spawned
    for shape in SHAPES:
        got, want, sequences, same_count = per_rank[0]["eval"][shape]
        assert per_rank[1]["eval"][shape][0] == got  # one all-reduce: every rank the same value
        assert same_count and sequences >= 2 and sequences % shape[0] == 0
        assert got == pytest.approx(want, rel=1e-5), shape
        assert 5.0 < want < 6.5  # ~log(320) = 5.77 for random weights


def _rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_few_training_steps_on_jsonl_and_parquet_with_a_bpe_tokenizer(spawned):
    per_rank, out = spawned
    summary = per_rank[0]["train"][0]
    assert per_rank[1]["train"] == [None, None] and summary["steps"] == 3
    rows = _rows(out / "train")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert ["eval_loss" in r for r in rows] == [False, True, True]  # every 2 steps and at the end
    assert all(math.isfinite(r["loss"]) for r in rows)
    # it learns: the same held-out documents score better after one more step
    assert rows[2]["eval_loss"] < rows[1]["eval_loss"], rows
    assert summary["eval_loss"] == rows[2]["eval_loss"] and summary["eval"] == [[2, rows[1]["eval_loss"]],
                                                                                [3, rows[2]["eval_loss"]]]
    assert math.isfinite(summary["eval_loss"])
    # the evaluations change nothing in training: the run without them (whose stream starts with the same
    # sequences: the held-out documents are the last of the order) has the very same losses
    assert [r["loss"] for r in _rows(out / "no-eval")] == [r["loss"] for r in rows]
    assert per_rank[0]["train"][1]["eval_loss"] is None and per_rank[0]["train"][1]["eval"] == []


def test_the_plot_draws_the_validation_loss_as_a_second_curve(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from flashpar.cp import plan
    from flashpar.train.report import plot

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at its curves
    rows = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.5, "eval_loss": 4.8}, {"step": 3, "loss": 4.2},
            {"step": 4, "loss": 4.0, "eval_loss": 4.4}]
    plot(rows, plan([30, 20, 14], 2), tmp_path / "train.png")
    assert (tmp_path / "train.png").stat().st_size > 0
    lines = figures[0].axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["training", "validation (held out)"]
    assert list(lines[1].get_xdata()) == [2, 4] and list(lines[1].get_ydata()) == [4.8, 4.4]

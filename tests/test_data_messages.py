"""Nothing silent about the data: left-out files named, tokenizing announced with a bar, a run whose data run out
before --steps warned at the start and told at the end."""

from __future__ import annotations

import json

from flashpar.cli import main
from flashpar.train.sources import SUFFIXES, skipped, skipped_line


def _docs(root, names):
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"text": "def f(x):\n    return x\n" * 40}) + "\n" if name.endswith(".jsonl")
                        else "def f(x):\n    return x\n" * 40)


def test_skipped_files_are_counted_and_named(tmp_path):
    _docs(tmp_path, ["a.txt", "b.jsonl", "notes/c.md", "code/d.py", "e.csv", "README", "f1.rst", "f2.rst", "f3.rst"])
    assert skipped([tmp_path]) == ["README", "code/d.py", "e.csv", "f1.rst", "f2.rst", "f3.rst"]
    line = skipped_line([tmp_path], shown=3)
    assert line == (f"--data: skipped 6 files without a {', '.join(SUFFIXES)} suffix: README, code/d.py, e.csv "
                    "and 3 more")
    assert skipped_line([tmp_path / "a.txt"]) == ""  # a file given by name is read or refused, never skipped


def test_a_run_says_what_it_skips_tokenizes_and_when_its_data_run_out(tmp_path, capfd):
    """One process (the smallest mesh), byte tokens of two documents of 1000 bytes: 3 sequences of 512 tokens,
    twice (--epochs 2), so --steps 8 stops at step 6; every message on the way is one line."""
    docs = tmp_path / "docs"
    _docs(docs, ["a.txt", "b.txt", "skip.py"])
    argv = ["train", "--data", str(docs), "--nproc", "1", "--cp", "1", "--tp", "1", "--seq-len", "512",
            "--workers", "0", "--steps", "8", "--epochs", "2", "--out", str(tmp_path / "run"), "--timeout", "60"]
    assert main(argv) == 0
    out, err = capfd.readouterr()
    assert f"flashpar train: --data: skipped 1 file without a {', '.join(SUFFIXES)} suffix: skip.py" in err, err
    assert f"flashpar: tokenizing --data {docs} into" in err and "tokenizing: " in err, err
    warning = ("flashpar train: warning: the training data hold 6 more steps of dp x micro-batches = 1 x 1 "
               "sequences: the run will stop at step 6, before --steps 8 (--epochs 2: each sequence is used 2 times")
    assert warning in err, err
    assert "trained 6 steps" in out and "the training data ran out at step 6, before --steps 8 after --epochs 2" in out
    # the second pass takes the first's sequences in the same order: the same plans, step for step
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["plan_kv_bytes"] for r in rows[:3]] == [r["plan_kv_bytes"] for r in rows[3:]]


def test_epochs_continue_the_stream_of_global_sequences():
    """dp rank 1 of 2 over 2 passes of a 5-sequence dataset: global sequences 1, 3, 5, 7, 9 -> 1, 3, 0, 2, 4."""
    from flashpar.train.data import PlannedSequences

    class Five:
        def __len__(self):
            return 5

        def __getitem__(self, k):
            return {"k": k, "doc_lens": [64], "tokens": None}

    planned = PlannedSequences(Five(), 1, "per_doc", dp_rank=1, dp_size=2, epochs=2)
    assert len(planned) == 5 and [planned[j]["k"] for j in range(5)] == [1, 3, 0, 2, 4]
    resumed = PlannedSequences(Five(), 1, "per_doc", dp_rank=1, dp_size=2, start=6, epochs=2)  # after 3 steps
    assert [resumed[j]["k"] for j in range(len(resumed))] == [2, 4]
    assert len(PlannedSequences(Five(), 1, "per_doc", dp_rank=1, dp_size=2)) == 2  # one pass: sequences 1, 3

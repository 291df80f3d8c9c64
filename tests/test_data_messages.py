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
    so --steps 5 stops at step 3; every message on the way is one line."""
    docs = tmp_path / "docs"
    _docs(docs, ["a.txt", "b.txt", "skip.py"])
    argv = ["train", "--data", str(docs), "--nproc", "1", "--cp", "1", "--tp", "1", "--seq-len", "512",
            "--workers", "0", "--steps", "5", "--out", str(tmp_path / "run"), "--timeout", "60"]
    assert main(argv) == 0
    out, err = capfd.readouterr()
    assert f"flashpar train: --data: skipped 1 file without a {', '.join(SUFFIXES)} suffix: skip.py" in err, err
    assert f"flashpar: tokenizing --data {docs} into" in err and "tokenizing: " in err, err
    warning = ("flashpar train: warning: the training data hold 3 more steps of dp x micro-batches = 1 x 1 "
               "sequences: the run will stop at step 3, before --steps 5")
    assert warning in err, err
    assert "trained 3 steps" in out and "the training data ran out at step 3, before --steps 5" in out, out

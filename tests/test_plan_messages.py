"""``flashpar plan``'s one-line errors and its table header: the file's line, the pack's tokens and documents,
--plot refused before any planning when matplotlib is missing."""

from __future__ import annotations

import sys

import pytest

from flashpar.cli import main
from flashpar.cp.lengths import parse_lengths


@pytest.mark.parametrize("text, error", [
    ("1000 2000\n3000\nabc\n", "f.txt line 3: 'abc' is not an integer length"),
    ("\n\n12\n-4\n", "f.txt line 4: -4; document lengths must be positive"),
    ("[1, 2, \"x\"]", "f.txt entry 2 of the JSON list: 'x' is not an integer length"),
    ("  \n", "f.txt: no lengths"),
])
def test_length_errors_name_the_line(text, error):
    with pytest.raises(ValueError) as err:
        parse_lengths(text, "f.txt")
    assert str(err.value) == error


def test_lengths_on_lines_and_in_json():
    assert parse_lengths("5\n6 7\n\n8\n", "f") == [5, 6, 7, 8] == parse_lengths("[5, 6, 7, 8]", "f")


def test_bad_file_is_one_line(tmp_path, capsys):
    path = tmp_path / "lengths.txt"
    path.write_text("100\n200\nthree hundred\n")
    assert main(["plan", "--lengths", str(path), "--cp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"flashpar plan: {path} line 3: 'three' is not an integer length", err


def test_header_counts_tokens_and_documents(tmp_path, capsys):
    path = tmp_path / "five.txt"
    path.write_text("1200\n3000\n5000\n4000\n4000\n")
    assert main(["plan", "--lengths", str(path), "--cp", "2", "--strategy", "flashcp"]) == 0
    title = capsys.readouterr().out.splitlines()[0]
    assert title.startswith(f"== {path}: one pack of 17200 tokens (5 documents), N=2"), title


def test_plot_without_matplotlib_fails_before_planning(tmp_path, capsys, monkeypatch):
    import flashpar.cp

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: find_spec says None

    def no_planning(*args, **kwargs):
        raise AssertionError("planned before checking --plot")

    monkeypatch.setattr(flashpar.cp, "plan", no_planning)
    path = tmp_path / "l.txt"
    path.write_text("100\n200\n")
    assert main(["plan", "--lengths", str(path), "--cp", "2", "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "flashpar plan: --plot needs matplotlib (pip install 'flashpar[plot]')", err

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


def test_the_cp_groups_link_follows_the_trainers_placement():
    """``--gpus-per-node``: cp 4 x tp 2 on nodes of 8 keeps the cp group (ranks 0 2 4 6) on one node's NVLink; on
    nodes of 4 it spans 2 nodes and plans on the port; without it, the port (the default)."""
    from flashpar.cost import preset
    from flashpar.cp.cli import NODE_HARDWARE, cp_link
    from flashpar.cp.cost import DEFAULT_HARDWARE

    hw, words = cp_link(4, 2, 8)
    assert (hw.nodes, hw.link_bytes_per_s, words) == (1, preset(NODE_HARDWARE).link_bytes_per_s,
                                                      f"{NODE_HARDWARE} link, one node")
    hw, words = cp_link(4, 2, 4)
    assert (hw.nodes, hw.link_bytes_per_s, words) == (2, preset(DEFAULT_HARDWARE).link_bytes_per_s,
                                                      f"{DEFAULT_HARDWARE} link across 2 nodes")
    assert cp_link(4, 1, None)[0] == preset(DEFAULT_HARDWARE)
    with pytest.raises(ValueError, match="^--tp 3 would span nodes of --gpus-per-node 4"):
        cp_link(2, 3, 4)
    with pytest.raises(ValueError, match="give --gpus-per-node too"):
        cp_link(2, 2, None)


def test_plan_on_one_node_names_its_link_and_a_bad_placement_is_one_line(tmp_path, capsys):
    path = tmp_path / "five.txt"
    path.write_text("1200\n3000\n5000\n4000\n4000\n")
    assert main(["plan", "--lengths", str(path), "--cp", "2", "--strategy", "flashcp", "--gpus-per-node", "8"]) == 0
    assert "N=2 (h100-nvlink link, one node)" in capsys.readouterr().out
    assert main(["plan", "--lengths", str(path), "--cp", "2", "--tp", "3", "--gpus-per-node", "2"]) == 2
    assert capsys.readouterr().err.strip() == ("flashpar plan: --tp 3 would span nodes of --gpus-per-node 2 (tp runs "
                                               "inside a node)")

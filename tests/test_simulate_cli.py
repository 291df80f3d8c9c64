"""``flashpar simulate``: the subcommands exist, and ``check`` tells a benchmark's report by its keys."""

from __future__ import annotations

import json

import pytest

from flashpar.cli import main
from flashpar.sim.check import finish, kind_of
from flashpar.sim.report import table


def test_kind_of_each_benchmark_report():
    assert kind_of({"world_size": 2, "hardware": {}, "shapes": []}) == "overlap"
    assert kind_of({"world_size": 4, "fwd_cost": {}, "bwd_cost": {}, "rows": {}}) == "cp"
    assert kind_of({"setup": {}, "configs": []}) == "train"
    with pytest.raises(ValueError, match="not a `flashpar bench overlap|cp|train` report"):
        kind_of({"rows": []})
    with pytest.raises(ValueError, match="a JSON list, expected an object"):
        kind_of([1, 2])


def test_finish_fills_error_and_within():
    assert finish({"predicted": 1.1, "measured": 1.0})["within"] == "yes"
    row = finish({"predicted": 1.2, "measured": 1.0})
    assert row["within"] == "no" and row["error"] == pytest.approx(0.2)


def test_table_aligns_and_marks_missing():
    text = table([{"a": "x", "b": 1.5}, {"a": "long", "b": None}], [("a", ""), ("b", ".2f")])
    assert text.splitlines() == ["a        b", "x     1.50", "long     -"]


@pytest.mark.parametrize("content, message", [
    ("not json", "not JSON"),
    ("[]", "a JSON list, expected an object"),
    ('{"rows": {}}', "not a `flashpar bench"),
])
def test_check_refuses_bad_files_with_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "bench.json"
    path.write_text(content)
    assert main(["simulate", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert main(["simulate", "check", str(tmp_path / "missing.json")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_json_layout(tmp_path):
    from flashpar.sim.report import write_json
    path = tmp_path / "out.json"
    write_json(str(path), {"k": 1}, [{"a": 1}])
    assert json.loads(path.read_text()) == {"setup": {"k": 1}, "rows": [{"a": 1}]}

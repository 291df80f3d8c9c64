"""`flashpar simulate overlap` and `flashpar simulate check` of a `bench overlap` report (pure Python, no group)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from flashpar import cost
from flashpar.overlap.simulate import predict
from flashpar.sim import check as sim_check
from flashpar.sim import check_overlap
from flashpar.sim import overlap as sim_overlap
from flashpar.sim.bench_runs import BenchShape

H100 = cost.preset("h100-nvlink")
TOL = check_overlap.TOLERANCE


def _run(module, argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return module.run(p.parse_args(argv))


def _rows(argv: list[str], tmp_path) -> tuple[dict, list[dict]]:
    out = tmp_path / "o.json"
    assert _run(sim_overlap, [*argv, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    return data["setup"], data["rows"]


def test_none_exposes_all_of_its_forward_communication_and_flash_hides_it(tmp_path, capsys):
    # TP=4 MLP at 32K tokens, h 2048: compute-bound on an H100 (forward comm / compute about 0.6)
    setup, rows = _rows(["--block", "mlp", "--tp", "4", "--batch", "8", "--seq", "4096", "--hidden", "2048"], tmp_path)
    by = {(r["mode"], r["chunks"]): r for r in rows}
    none, flash = by[("none", 1)], by[("flash", 1)]
    # none: one blocking collective, then the GEMM: every byte of the forward is exposed
    assert none["exposed_fwd_ms"] == pytest.approx(none["comm_fwd_ms"], rel=1e-9) and none["comm_fwd_ms"] > 0
    assert none["fwd_ms"] == pytest.approx(none["compute_fwd_ms"] + none["comm_fwd_ms"], rel=1e-9)
    # flash moves the same bytes, as 3 messages of 11.8 us where NCCL's collective pays its own latency,
    # behind the GEMM pieces: less exposed, forward and in total
    block = 32768 // 4 * 2048 * 2  # bytes of one rank's rows of x, bf16
    nccl = H100.collective("all_gather", 4, 4 * block)
    assert none["comm_fwd_ms"] == pytest.approx(2 * nccl.total_s * 1e3, rel=1e-9)  # gate/up's and down's
    assert flash["comm_fwd_ms"] == pytest.approx(2 * 3 * H100.transfer_time(block) * 1e3, rel=1e-9)
    assert flash["comm_fwd_ms"] - 6 * H100.link_latency_s * 1e3 == pytest.approx(
        none["comm_fwd_ms"] - 2 * nccl.latency_s * 1e3, rel=1e-9)  # the same bytes at the same rate
    assert flash["exposed_fwd_ms"] < 0.1 * none["exposed_fwd_ms"]
    assert flash["exposed_fwd_ms"] + flash["exposed_bwd_ms"] < none["exposed_fwd_ms"] + none["exposed_bwd_ms"]
    assert flash["vs_none"] < 1.0
    # the block is the two ops the runtime runs, each timed by the simulator on its own schedule
    gu, down = setup["linears"]
    assert (gu["op"], gu["n_out"], down["op"], down["n_in"]) == ("ag_matmul", 2 * setup["ffn"] // 4, "matmul_rs",
                                                                  setup["ffn"] // 4)
    one = predict("ag_matmul", "flash", 1, 4, 32768, 2048, gu["n_out"], 2, H100)
    assert flash["gate_up_fwd_ms"] == pytest.approx(one["ag_matmul"].total * 1e3, rel=1e-12)
    assert "simulated, h100-nvlink preset" in capsys.readouterr().out


def test_auto_merges_pieces_at_tp8_on_short_sequences(tmp_path):
    # Llama-3-8B's MLP at tp 8, 1024 tokens per rank: one piece per peer pays 7 latencies and 7 small-M GEMMs.
    # gate/up's backward (x gathered again, grad_x reduce-scattered beside the weight-gradient GEMM) gains
    # nothing from cutting: picked apart, it stays blocking while the forward merges pieces
    setup, rows = _rows(["--block", "mlp", "--tp", "8", "--seq", "8192", "--hidden", "4096", "--ffn", "14336"],
                        tmp_path)
    auto = rows[-1]
    picked = "gate_up:flash(k=1,g=4)/none(k=1) down:flash(k=1,g=3)/flash(k=1,g=4)"
    assert auto["mode"] == "auto" and auto["picked"] == picked
    gu = setup["linears"][0]
    merged = predict("ag_matmul", "flash", 1, 8, 8192, 4096, gu["n_out"], 2, H100, peers_per_piece=4)
    none = predict("ag_matmul", "none", 1, 8, 8192, 4096, gu["n_out"], 2, H100)
    assert auto["gate_up_fwd_ms"] == pytest.approx(merged["ag_matmul"].total * 1e3, rel=1e-12)
    assert auto["gate_up_bwd_ms"] == pytest.approx(none["ag_matmul_bwd"].total * 1e3, rel=1e-12)
    assert auto["vs_none"] < 0.9 and auto["vs_none"] < min(r["vs_none"] for r in rows[:-1])


def test_json_layout_and_modes(tmp_path):
    setup, rows = _rows(["--block", "attention", "--ulysses", "2", "--seq", "1024", "--hidden", "512",
                         "--heads", "8", "--kv-heads", "2", "--chunks", "1,2", "--hardware", "h100-ib"], tmp_path)
    assert setup["simulated"] is True and setup["hardware"] == "h100-ib" and setup["ulysses"] == 2
    for r in rows:
        assert {"mode", "chunks", "fwd_ms", "bwd_ms", "exposed_fwd_ms", "exposed_bwd_ms"} <= set(r)
    # all-to-all ops have no ring; slice only with more than one slice; auto last
    assert [(r["mode"], r["chunks"]) for r in rows] == [("none", 1), ("flash", 1), ("flash", 2), ("slice", 2),
                                                        ("auto", None)]
    assert [lin["op"] for lin in setup["linears"]] == ["matmul_a2a", "a2a_matmul"]
    # ZeRO-3 over dp: each MLP linear is the sharded op, its whole weight gathered over the 4 dp ranks
    setup, rows = _rows(["--block", "mlp", "--dp", "4", "--seq", "1024", "--hidden", "512"], tmp_path)
    assert [(lin["op"], lin["n"], lin["n_out"]) for lin in setup["linears"]] == [("sharded", 4, 2 * setup["ffn"]),
                                                                                ("sharded", 4, 512)]
    assert ("ring", 4) in {(r["mode"], r["chunks"]) for r in rows}


def test_paper_note_prints_both_figures(capsys):
    assert _run(sim_overlap, ["--block", "mlp", "--tp", "4", "--batch", "32", "--seq", "4096", "--hidden", "4096",
                              "--paper"]) == 0
    out = capsys.readouterr().out
    assert "43.8 ms -> 0.1 ms" in out and "not like for like" not in out and "GB/s" in out


@pytest.mark.parametrize("argv, message", [
    (["--tp", "0"], "--tp must be >= 1"),
    (["--block", "op"], "--op goes with --block op"),
    (["--block", "op", "--op", "ag_matmul", "--tp", "1"], "needs --tp >= 2"),
    (["--tp", "3", "--ffn", "1000", "--seq", "3"], "not divisible by --tp 3"),
    (["--tp", "2", "--dp", "2"], "nested"),
    (["--tp", "2", "--ulysses", "2"], "both split the heads"),
    (["--hardware", "tpu"], "unknown hardware preset"),
    (["--chunks", "x"], "--chunks must be"),
])
def test_bad_arguments_give_one_line(argv, message, capsys):
    assert _run(sim_overlap, argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


# ------------------------------------------------------------------------------------------------
# simulate check on a bench overlap report


def _synthetic_report(n: int = 2, hw: cost.Hardware | None = None) -> dict:
    """A `flashpar bench overlap` report whose measurements are the simulator's own predictions on ``hw``."""
    hw = hw or cost.preset("cpu")
    shapes = []
    for shape in (BenchShape("ag-hidden", "ag", 256, 512, 1024, 0.5), BenchShape("out-hidden", "out", 256, 512, 768)):
        sim_op, *dims = shape.sim_args(n)
        modes = []
        for mode, chunks in (("none", None), ("flash", 1), ("flash", 4), ("slice", 4), ("auto", None)):
            run = ("flash", 1) if mode == "auto" else (mode, chunks or 1)
            t = predict(sim_op, *run, n, *dims, 4, hw)
            row = {"mode": mode, "chunks": chunks, "predicted": {k: v.total for k, v in t.items()}}
            if mode == "auto":
                row["picked"] = "flash(k=1)"
            for direction, v in zip(("forward", "backward"), t.values(), strict=True):
                row[direction] = {"compute": v.compute, "comm": v.comm, "overlapped": v.total,
                                  "ideal": max(v.compute, v.comm), "ovl_ideal": v.total / max(v.compute, v.comm)}
            modes.append(row)
        shapes.append({"shape": shape.__dict__, "modes": modes})
    return {"world_size": n, "dtype": "float32", "hardware": hw.__dict__, "shapes": shapes}


def test_check_of_the_simulators_own_figures_is_exact():
    rows = [sim_check.finish(r) for r in check_overlap.check([_synthetic_report()])]
    assert len(rows) == 2 * (5 * 2 + 4 * 2)  # 2 shapes x (ovl/ideal per mode and direction + vs none but none's)
    assert max(abs(r["error"]) for r in rows) < 1e-12 and all(r["within"] == "yes" for r in rows)


def test_check_charges_the_reports_contention_term_and_reads_reports_without_it():
    # measured on a box where transfers take 2 ns of CPU per byte from the GEMMs beside them
    report = _synthetic_report(hw=replace(cost.preset("cpu"), comm_cpu_s_per_byte=2e-9))
    rows = {(r["row"], r["figure"]): sim_check.finish(r) for r in check_overlap.check(report)}
    assert max(abs(r["error"]) for r in rows.values()) < 1e-12
    flash = rows[("N=2 ag-hidden flash(k=1) fwd", "ovl/ideal")]
    assert flash["predicted"] > 1.01  # overlap is not free there
    # the same report written before the term existed: the prediction is the contention-free one (lower)
    del report["hardware"]["comm_cpu_s_per_byte"]
    old = {(r["row"], r["figure"]): r for r in check_overlap.check(report)}
    assert old[("N=2 ag-hidden flash(k=1) fwd", "ovl/ideal")]["predicted"] < flash["predicted"]
    assert old[("N=2 ag-hidden none(k=1) fwd", "ovl/ideal")]["predicted"] == pytest.approx(
        rows[("N=2 ag-hidden none(k=1) fwd", "ovl/ideal")]["predicted"], rel=1e-12)  # none's forward overlaps nothing


def test_a_miss_inside_the_contention_figures_interval_is_explained_and_one_outside_is_not():
    # measured where transfers take 6 ns/byte from the GEMMs; the calibration's median says 1 ns/byte
    report = _synthetic_report(hw=replace(cost.preset("cpu"), comm_cpu_s_per_byte=6e-9))
    report["hardware"]["comm_cpu_s_per_byte"] = 1e-9
    key = ("N=2 ag-hidden flash(k=1) fwd", "ovl/ideal")
    for (q25, q75), explained in (((-4e-9, 8e-9), True), ((0.95e-9, 1.05e-9), False)):
        # 9 pairs: interval 1 +- 1.57 IQR / 3 ns/byte = [0, 7.3] (holds 6) or [0.95, 1.05] (does not)
        report["comm_cpu"] = {"s_per_byte": 1e-9, "q25": q25, "q75": q75, "pairs": 9}
        rows = {(r["row"], r["figure"]): sim_check.finish(r) for r in check_overlap.check(report)}
        assert rows[key]["within"] == "no" and rows[key]["error"] < -TOL, rows[key]
        assert rows[key]["why"].startswith("contention figure's own interval") == explained, rows[key]["why"]


def test_check_flags_a_perturbed_measurement(tmp_path, capsys):
    report = _synthetic_report()
    slice4 = report["shapes"][0]["modes"][3]["forward"]
    slice4["overlapped"] *= 1.3  # 30% slower overlapped than the model, its parts as predicted
    slice4["ovl_ideal"] *= 1.3
    rows = [sim_check.finish(r) for r in check_overlap.check(report)]
    missed = [r for r in rows if r["within"] == "no"]
    assert {(r["row"], r["figure"]) for r in missed} == {("N=2 ag-hidden slice(k=4) fwd", "ovl/ideal"),
                                                         ("N=2 ag-hidden slice(k=4) fwd", "vs none")}
    assert all(r["error"] == pytest.approx(1 / 1.3 - 1) for r in missed)
    assert all(r["why"] == "" for r in missed)  # nothing in the report explains it: unexplained
    path = tmp_path / "bench.json"
    path.write_text(json.dumps([report]))
    assert _run(sim_check, [str(path), "--strict"]) == 1
    assert "2 miss(es), 2 unexplained" in capsys.readouterr().out


def test_check_explains_a_miss_by_the_parts_or_by_the_runs_own_spread():
    report = _synthetic_report()
    none, flash, auto = (report["shapes"][0]["modes"][i]["forward"] for i in (0, 1, 4))
    # none's comm-only run 3x as slow as calibrated, overlapped = compute + comm as the model composes it
    none["comm"] *= 3
    none["overlapped"] = none["compute"] + none["comm"]
    none["ovl_ideal"] = none["overlapped"] / max(none["compute"], none["comm"])
    # auto ran flash(k=1) again and measured it 40% slower than the flash(k=1) row
    auto["overlapped"] *= 1.4
    auto["ovl_ideal"] *= 1.4
    rows = {(r["row"], r["figure"]): sim_check.finish(r) for r in check_overlap.check(report)}
    r = rows[("N=2 ag-hidden none(k=1) fwd", "ovl/ideal")]
    assert r["within"] == "no" and r["from_parts"] == pytest.approx(r["measured"], rel=1e-9)
    assert r["why"].startswith("parts off calibration (compute-only x1.00, comm-only x3.00)")
    r = rows[("N=2 ag-hidden auto>flash(k=1) fwd", "ovl/ideal")]
    assert r["within"] == "no" and r["why"] == "noise: auto re-ran flash(k=1) 40% apart"
    assert flash["overlapped"] > 0


def test_a_miss_inside_its_own_rounds_spread_is_noise_and_one_whose_rounds_agree_is_not():
    report = _synthetic_report()
    for entry in report["shapes"]:  # 8 rounds each measuring exactly the medians
        for m in entry["modes"]:
            for d in ("forward", "backward"):
                f = m[d]
                f["samples"] = {k: [f[k]] * 8 for k in ("overlapped", "compute", "comm")}
    slice4 = report["shapes"][0]["modes"][3]["forward"]
    slice4["overlapped"] *= 1.3  # 30% slower than the model: a 23% miss of ovl/ideal and of vs none
    slice4["ovl_ideal"] *= 1.3
    keys = [("N=2 ag-hidden slice(k=4) fwd", "ovl/ideal"), ("N=2 ag-hidden slice(k=4) fwd", "vs none")]

    def whys(factors):
        slice4["samples"]["overlapped"] = [slice4["overlapped"] / 1.3 * f for f in factors]
        rows = {(r["row"], r["figure"]): sim_check.finish(r) for r in check_overlap.check(report)}
        assert all(rows[k]["within"] == "no" and rows[k]["error"] == pytest.approx(1 / 1.3 - 1) for k in keys)
        return [rows[k]["why"] for k in keys]

    # rounds that agree on 1.3x: interval [1.3, 1.3], and 0.85 x 1.3 > 1: the miss stays unexplained
    assert whys([1.3] * 8) == ["", ""]
    # rounds spread 0.9x-1.6x (quartiles 1.025 and 1.475): median 1.25 +- 1.57 x 0.45 / sqrt(8) = [1.0, 1.5]
    assert all(w.startswith("noise: its 8 rounds put the ratio at") and "within 15% of the prediction" in w
               for w in whys([0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]))
    # as wide a spread around 2x: [1.75, 2.25] x 0.85 > 1, the prediction is not within 15% of it
    slice4["overlapped"] *= 2 / 1.3
    slice4["ovl_ideal"] *= 2 / 1.3
    slice4["samples"]["overlapped"] = [slice4["overlapped"] / 2 * (f + 0.75) for f in
                                       (0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6)]
    rows = {(r["row"], r["figure"]): r for r in check_overlap.check(report)}
    assert [rows[k]["why"] for k in keys] == ["", ""]
    slice4["samples"]["comm"] = slice4["samples"]["comm"][:7]  # a malformed file: one clear error
    with pytest.raises(ValueError, match="per-round samples have different lengths"):
        check_overlap.check(report)


def test_simulate_check_reads_a_merged_pick_and_times_its_schedule():
    """A ``bench overlap`` row of ``auto`` that picked merged pieces (``flash(k=1,g=3)``) is rebuilt as that
    schedule: at N = 4 the 3 peers in one piece, one exchange (one latency) instead of three."""
    from flashpar.cost import preset
    from flashpar.overlap.schedule import Exchange, build_schedule
    from flashpar.sim import check_overlap

    assert check_overlap._run_mode({"mode": "auto", "picked": "flash(k=1,g=3)"}) == ("flash", 1, 3)
    assert check_overlap._run_mode({"mode": "auto", "picked": "none(k=1)"}) == ("none", 1, 1)
    assert check_overlap._run_mode({"mode": "flash", "chunks": 2}) == ("flash", 2, 1)
    merged = check_overlap._predict("ag_matmul", {"mode": "auto", "picked": "flash(k=1,g=3)"}, 4, (64, 32, 32), 4,
                                    preset("h100-nvlink"))
    per_peer = check_overlap._predict("ag_matmul", {"mode": "flash", "chunks": 1}, 4, (64, 32, 32), 4,
                                      preset("h100-nvlink"))
    one_item = sum(isinstance(s, Exchange) for s in build_schedule("ag_matmul", "flash", 4, 0, peers_per_piece=3).steps)
    assert one_item == 1 and merged.comm < per_peer.comm  # one latency instead of three

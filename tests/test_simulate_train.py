"""``flashpar simulate train`` and ``simulate check`` of a ``bench train`` report: pure Python, no process group."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from flashpar import cli
from flashpar.cost import preset
from flashpar.models.config import LlamaConfig
from flashpar.sim import check_train, memory, predict, step
from flashpar.sim.model_configs import load_model
from flashpar.sim.peers import PEERS
from flashpar.sim.topology import Cluster, Layout
from flashpar.sim.workload import Workload

H100 = Cluster(preset("h100-nvlink"), preset("h100-ib"))
TINY = LlamaConfig(vocab_size=64, hidden=16, layers=2, heads=4, kv_heads=2, ffn=32, tie_embeddings=False)


def _sim(argv, capsys) -> tuple[int, str, str]:
    code = cli.main(["simulate", "train", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- the model ----------------------------------------------------------------------------------------------


def test_llama3_8b_has_8_billion_parameters_and_6n_plus_attention_flops_per_token():
    cfg = load_model("llama3-8b")
    # embedding + untied head 2 x 128256 x 4096; 32 blocks of q, k, v, o (4096 x 6144 + 4096 x 4096) and the
    # SwiGLU (3 x 4096 x 14336) with two norms; the final norm
    by_hand = 2 * 128256 * 4096 + 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096) + 4096
    assert cfg.params == by_hand and abs(cfg.params / 8.03e9 - 1) < 0.001
    assert abs(load_model("llama3-70b").params / 70.55e9 - 1) < 0.001
    keys = 2048.5  # one 4096-token document: (4096 + 1) / 2 keys per query on average
    assert cfg.flops_per_token(keys) == 6 * cfg.matmul_params + 12 * 32 * 32 * 128 * keys
    w = Workload(cfg, Layout(1, 1, 1, 8), H100, ((4096, 4096),))
    assert w.keys_per_token == keys
    r = predict.simulate(w, PEERS["flashpar"])
    assert r["flops"] == 8192 * cfg.flops_per_token(keys)
    assert math.isclose(r["mfu"], r["flops"] / r["step_s"] / (989e12 * 8))


def test_memory_per_gpu_by_hand_on_a_small_model():
    """dp 2 x tp 2, ZeRO-3 over the shard group S = dp x cp x U (2 ranks): a block's projections (16 x 16 q,
    16 x 8 k and v, 16 x 16 o, 3 x 16 x 32 MLP = 2304) / tp and the two tables 64 x 16 / tp, all / |S|; the
    norms (2 x 16 per block, 16 final) whole."""
    w = Workload(TINY, Layout(2, 1, 1, 2), H100, ((64,),), elem_bytes=2)
    p = (2 * 2304 / 2 + 2 * 64 * 16 / 2) / 2 + (2 * 2 * 16 + 16)
    assert memory.local_params(w, PEERS["flashpar"]) == p == 1744
    assert memory.local_params(w, PEERS["torch"]) == TINY.params / 2 / 2  # FSDP2 over dp x cp, then tp
    # activations (bf16): per token of the cp rank (64) and block, 4 h / tp (32) rows, the gathered inputs of
    # q/k/v and gate/up 2 h (tp - 1) / tp (16: a prefetched block runs the plain tp op, which keeps them), q k v
    # (2 + 2 x 1) x 4 (16), the attention output 2 x 4 (8), 4 ffn / tp (64): 136 elements; the head's gathered
    # input 64 x 16 (kept); the logits 64 x 32 x (2 + 8) bytes
    acts = 2 * 64 * 136 * 2 + 64 * 16 * 2 + 64 * 32 * 10
    assert memory.activations(w, PEERS["flashpar"], 0.0) == acts
    fused = ("fused", "fused")  # the fused ZeRO-3 linears gather their input again: 16 fewer per token
    assert memory.activations(w, PEERS["flashpar"], 0.0, fused) == acts - 2 * 64 * 16 * 2
    # buffers: K + 1 = 2 gathered units (2304 / 2 = 1152 elements, bf16) and one unit's fp32 gradient, plus the
    # head's table (64 x 16 / 2) and the last block kept gathered; baseline (K = 0) one unit; every block fused:
    # the largest tp-shard weight (gate / up, 16 x 64 / 2) bf16 + fp32 and the head's table
    kept = (512 + 1152) * 2
    assert memory.buffers(w, PEERS["flashpar"]) == 2 * 1152 * 2 + 1152 * 4 + kept
    assert memory.buffers(w, PEERS["baseline"]) == 1152 * 2 + 1152 * 4 + kept
    assert memory.buffers(w, PEERS["flashpar"], fused) == 512 * (2 + 4) + 512 * 2
    mem = memory.memory(w, PEERS["flashpar"], 0.0)
    assert mem["total"] == pytest.approx((16 * p + acts + 2 * 1152 * 2 + 1152 * 4 + kept) / 1e9)
    ckpt = dataclasses.replace(w, checkpoint_activations=True)  # block inputs (h / tp per token) + one block
    assert memory.activations(ckpt, PEERS["flashpar"], 0.0) == 2 * 64 * 8 * 2 + 64 * 136 * 2 + 64 * 16 * 2 + \
        64 * 32 * 10
    # dp 1: the head keeps its gathered input, 64 x 16 / 2 more than its own rows, and the block linears theirs;
    # --regather keeps neither
    kept_w = Workload(TINY, Layout(1, 1, 1, 2), H100, ((64,),), elem_bytes=2)
    again = dataclasses.replace(kept_w, regather=True)
    more = memory.activations(kept_w, PEERS["flashpar"], 0.0) - memory.activations(again, PEERS["flashpar"], 0.0)
    assert more == (2 * 64 * 16 + 64 * 16 / 2) * 2
    assert memory.activations(again, PEERS["torch"], 0.0) == memory.activations(kept_w, PEERS["torch"], 0.0)


def test_one_gpu_exposes_no_communication_and_every_configuration_takes_the_same_step():
    """One GPU: nothing is exposed and every configuration computes the same step, but for the torch peers'
    separate q / k / v and w1 / w3 projections (torchtitan's Llama: ``step.separate_projections``, forward and
    backward) and the attention kernels' launches, which the model charges flashpar's segment kernels
    (``cp.attention``: one call per ladder length of the documents, 2048 and 4096 here, forward and backward) and
    not torch's FlexAttention."""
    cfg = load_model("llama3-8b")
    w = Workload(cfg, Layout(1, 1, 1, 1), H100, ((2048, 4096, 2048),))
    steps = {}
    for name, peer in PEERS.items():
        r = predict.simulate(w, peer)
        assert all(v == 0.0 for v in r["exposed"].values()), r["exposed"]
        assert r["step_s"] == pytest.approx(r["no_comm_s"], rel=1e-12) and r["step_s"] > 0  # summed in another order
        steps[name] = r["step_s"]
    assert steps["flashpar"] == pytest.approx(steps["baseline"], rel=1e-12)
    assert steps["torch"] == pytest.approx(steps["torch_async_tp"], rel=1e-12)
    sf, sb = step.separate_projections(w, PEERS["torch"])
    assert sf.compute > 0 and sb.compute > 0
    extra = cfg.layers * (sf.compute + sb.compute)
    launches = cfg.layers * 2 * 2 * H100.device.gemm_overhead_s  # layers x (forward, backward) x 2 calls
    assert steps["torch"] - steps["flashpar"] == pytest.approx(extra - launches, rel=1e-6)


def test_flashpar_hides_tensor_parallel_communication_that_the_baseline_exposes():
    w = Workload(load_model("llama3-8b"), Layout(1, 2, 1, 8), H100, ((8192, 8192, 16384),))
    flash, none = (predict.simulate(w, PEERS[n]) for n in ("flashpar", "baseline"))
    assert flash["exposed"]["tp"] < 0.5 * none["exposed"]["tp"]
    assert flash["exposed"]["cp"] <= none["exposed"]["cp"]  # flashcp sends only the K/V the mask needs


def test_regather_adds_an_all_gather_per_column_linear_to_the_backward():
    """``--regather`` (``Workload.regather``): baseline's backward gathers the inputs of q/k/v, gate/up and the
    head again.  In mode none the gather is posted before the grad_x GEMM and waited for before the grad_w
    GEMMs, so it costs only what that GEMM does not cover: more exposed tp time, less than a blocking
    all-gather of ``T_u x h`` per such linear.  torch's DTensor linear keeps its input either way."""
    cfg = load_model("llama3-8b")
    w = Workload(cfg, Layout(1, 2, 1, 8), H100, ((8192, 8192, 16384),))
    again = dataclasses.replace(w, regather=True)
    kept_s, again_s = (predict.simulate(x, PEERS["baseline"])["exposed"]["tp"] for x in (w, again))
    gather = 7 * H100.device.transfer_time(16384 / 8 * cfg.hidden * 2)  # 7 peers' rows of T_u = 16384, bf16
    assert 0 < again_s - kept_s < (2 * cfg.layers + 1) * gather
    assert predict.simulate(w, PEERS["torch"])["step_s"] == predict.simulate(again, PEERS["torch"])["step_s"]


def test_a_vocabulary_smaller_than_the_tokens_moves_its_weights_not_the_activations():
    """``flashpar.models.vocab.gathers_weight`` in the simulator (``step.gathers_vocab``): 64 vocabulary rows
    against 4096 tokens of the cp rank.  flashpar and baseline all-gather each fp32 weight's other half (32 x 16)
    forward and reduce-scatter it backward: exactly that, exposed, and less than the activation path (the
    embedding's reduce-scatter of 2048 x 16, the head's all-gather, the loss all-reduces); each rank keeps only
    its own rows' input and the two gathered weights.  torch's plans move the activations either way."""
    slow = dataclasses.replace(preset("h100-nvlink"), link_bytes_per_s=1e8)  # bytes, not the latency, count
    w = Workload(TINY, Layout(1, 1, 1, 2), Cluster(slow, slow), ((4096,),), elem_bytes=2)
    moved = dataclasses.replace(w, gather_vocab=False)
    assert step.gathers_vocab(w, PEERS["baseline"]) and not step.gathers_vocab(moved, PEERS["baseline"])
    assert not step.gathers_vocab(w, PEERS["torch"])
    hw = w.groups(PEERS["baseline"])["tp"][1]
    weights = 2 * hw.transfer_time(32 * 16 * 4)  # untied: embedding and head
    (fwd, bwd), (fwd_moved, bwd_moved) = (_ends(x, PEERS["baseline"]) for x in (w, moved))
    assert fwd.exposed["tp"] == pytest.approx(weights) and bwd.exposed["tp"] == pytest.approx(weights)
    assert fwd.exposed["tp"] < fwd_moved.exposed["tp"] and bwd.exposed["tp"] < bwd_moved.exposed["tp"]
    acts, acts_moved = (memory.activations(x, PEERS["flashpar"], 0.0) for x in (w, moved))
    assert acts - acts_moved == pytest.approx(2 * 64 * 16 * 4 - 4096 * 16 / 2 * 2)  # + weights - gathered input
    assert _ends(w, PEERS["torch"])[0].total == _ends(moved, PEERS["torch"])[0].total


def _ends(w, peer):
    """(forward, backward) of the embedding and the head together."""
    (ef, eb), (hf, hb) = step.ends(w, peer)
    return ef.copy().add(hf), eb.copy().add(hb)


def test_ulysses_all_to_alls_are_hidden_by_flashpar_and_the_torch_peer_runs_them_as_cp():
    w = Workload(load_model("llama3-8b"), Layout(1, 2, 4, 1), H100, ((16384, 16384),))
    flash, none, peer = (predict.simulate(w, PEERS[n]) for n in ("flashpar", "baseline", "torch"))
    assert none["exposed"]["ulysses"] > 0 and flash["exposed"]["ulysses"] < 0.5 * none["exposed"]["ulysses"]
    assert peer["exposed"]["ulysses"] == 0 and peer["exposed"]["cp"] > 0  # torch: cp 2 x 4 = 8 ranks, no Ulysses
    assert w.sizes(PEERS["torch"])["cp_size"] == 8 and w.sizes(PEERS["flashpar"])["heads"] == 8


def test_groups_ride_nvlink_inside_a_node_and_infiniband_across():
    layout = Layout(4, 2, 1, 4)  # tp 4 wide, cp 8 wide: one node of 8; dp 32 wide
    kinds = {dim: H100.group(layout, (dim,))[2] for dim in ("tp", "cp", "dp")}
    assert kinds == {"tp": "nvlink", "cp": "nvlink", "dp": "ib"}
    assert H100.group(layout, ("dp",))[1].link_bytes_per_s == preset("h100-ib").link_bytes_per_s
    assert H100.group(Layout(1, 1, 1, 1), ("tp",))[0] == 1


# ---- the command --------------------------------------------------------------------------------------------


def test_search_prints_layouts_that_divide_the_gpus_and_fit_memory(tmp_path, capsys):
    out, lengths = tmp_path / "train.json", tmp_path / "lengths.json"
    lengths.write_text(json.dumps([3000, 1000, 4192, 500]))  # one pack of 8192 tokens (a short list: fast)
    code, text, err = _sim(["--search", "--gpus", "8", "--seq", "8192", "--configs", "flashpar,torch",
                            "--lengths", str(lengths), "--json", str(out)], capsys)
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["setup"]["simulated"] and report["setup"]["gpus"] == 8
    rows = report["rows"]
    assert {r["config"] for r in rows} == {"flashpar", "torch"}
    for r in rows:
        assert r["dp"] * r["cp"] * r["ulysses"] * r["tp"] == 8
        assert 8 % r["tp"] == 0 and (r["ulysses"] == 1 or r["tp"] == 1)
        for key in ("tokens_per_s", "mfu", "exposed_ms", "mem_gb", "step_ms", "exposed_tp_ms", "exposed_cp_ms",
                    "exposed_ulysses_ms", "exposed_dp_ms", "layout", "fits"):
            assert key in r, key
        assert r["exposed_ms"] == pytest.approx(sum(r[f"exposed_{k}_ms"] for k in ("tp", "ulysses", "cp", "dp")))
        assert r["fits"] == ("yes" if r["mem_gb"] <= 0.9 * 96 else "no")  # the default h100-96gb
    fits = [r for r in rows if r["config"] == "flashpar" and r["fits"] == "yes"]
    fastest = max(fits, key=lambda r: r["tokens_per_s"])
    assert f"fastest flashpar layout: {fastest['layout']}" in text
    # ZeRO-3 shards over dp x cp x U as FSDP2 does: cp 8 x tp 1 fits, each GPU holding an eighth of the 8B
    # weights' fp32 state (16 bytes x 8.03e9 / 8 = 16 GB of the total), and flashpar fits wherever torch does
    cp8 = next(r for r in rows if r["config"] == "flashpar" and r["layout"] == "dp1 cp8 u1 tp1")
    assert cp8["fits"] == "yes" and cp8["mem_weights_gb"] + cp8["mem_grads_gb"] + cp8["mem_optimizer_gb"] < 16.1
    fit = {c: {r["layout"] for r in rows if r["config"] == c and r["fits"] == "yes"} for c in ("flashpar", "torch")}
    assert fit["flashpar"] >= fit["torch"]


@pytest.mark.parametrize(("argv", "needle"), [
    (["--gpus", "64", "--dp", "3"], "does not match --gpus 64"),
    (["--tp", "3", "--gpus", "3"], "not divisible by tp = 3"),
    (["--tp", "2", "--ulysses", "2"], "both > 1"),
    (["--tp", "1", "--ulysses", "3"], "ulysses = 3"),
    (["--model", "no-such-model"], "--model"),
    (["--hardware", "h900"], "unknown hardware preset"),
    (["--search"], "--search needs --gpus"),
    (["--seq", "1001"], "not divisible by cp x ulysses x tp"),
    (["--configs", "flashpar,jax"], "--configs"),
    (["--lengths", "/no/such/file"], "--lengths"),
])
def test_bad_arguments_stop_with_one_line(argv, needle, capsys):
    code, _, err = _sim(argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("flashpar simulate train: ") and needle in err, err


# ---- simulate check of a bench train report -----------------------------------------------------------------


def _report(names=("flashpar", "baseline", "torch"), **setup) -> dict:
    """A bench train report of the default setup whose measured figures are the simulator's own predictions."""
    from flashpar.bench import train as bench_train

    p = __import__("argparse").ArgumentParser()
    bench_train.add_arguments(p)
    config = bench_train.config_of(p.parse_args([]))
    hw = dataclasses.asdict(preset("cpu"))
    s = {**config, **setup, "link_rate": "500mbit", "hardware": hw, "attn_fwd": {"attn_peak": 0.5, "attn_half": 60.0},
         "attn_bwd": {"attn_peak": 0.3, "attn_half": 60.0}}
    report = {"setup": s, "configs": [{"name": n} for n in names]}
    for row, (_, r) in zip(report["configs"], check_train.predict(report).items(), strict=True):
        step_ms, no_comm = 1e3 * r["step_s"], 1e3 * r["no_comm_s"]
        row.update(step_ms=step_ms, no_comm_ms=no_comm, exposed_ms=step_ms - no_comm,
                   tokens_per_s=s["seq_len"] * s["dp"] / r["step_s"])
    return report


def test_check_of_a_perfect_report_is_within_and_of_a_perturbed_one_flagged():
    from flashpar.bench import train as bench_train
    from flashpar.sim.check import finish, kind_of

    report = _report()
    assert kind_of(report) == "train"
    rows = [finish(r) for r in check_train.check(report)]
    expect = ["flashpar vs baseline", "flashpar vs torch"] * 2 + list(bench_train.DEFAULT_CONFIGS)
    assert [r["row"] for r in rows] == expect
    assert all(r["within"] == "yes" and abs(r["error"]) < 1e-9 for r in rows), rows
    slow = report["configs"][0]  # flashpar's communication 1.5 x the step longer than predicted
    slow.update(tokens_per_s=slow["tokens_per_s"] / 1.5, step_ms=slow["step_ms"] * 1.5,
                exposed_ms=slow["exposed_ms"] + slow["step_ms"] / 2)
    rows = [finish(r) for r in check_train.check(report)]
    assert [r["within"] for r in rows] == ["no"] * 4 + ["no", "yes", "yes"], rows
    assert "flashpar exposed" in rows[4]["why"]


def test_check_without_a_calibration_says_so_in_one_line(tmp_path, capsys):
    report = _report()
    del report["setup"]["hardware"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(report))
    assert cli.main(["simulate", "check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no calibration" in err, err


def test_chunk_calls_are_the_torch_peers_sdpa_calls():
    """cp 2, documents of 8 and 4 tokens: rank 1 holds chunks 1 and 2 of each (one piece each); each is cut at the
    chunk boundary and computes its rectangle against the document's earlier keys; rank 0's first chunks are
    square (``is_causal``: half the square and its diagonal)."""
    from flashpar.sim.step import chunk_calls

    starts, lens = [0, 8], [8, 4]
    assert chunk_calls([(2, 6), (9, 11)], lens, starts, 2) == [(2, 4, 8), (2, 6, 12), (1, 2, 2), (1, 3, 3)]
    assert chunk_calls([(0, 2), (6, 8), (8, 9), (11, 12)], lens, starts, 2) == [(2, 2, 3), (2, 8, 16), (1, 1, 1),
                                                                              (1, 4, 4)]
    assert chunk_calls([(0, 8)], [8], [0], 1) == [(8, 8, 36)]  # without cp: one causal call per document


def test_check_predicts_every_torch_peer_and_the_dense_one_slower():
    """A report with the three torch peers: each gets its ratio row; the dense peer's attention computes every
    S_loc x S score, so it is predicted slower than the per-document peer."""
    report = _report(names=("flashpar", "torch", "torch_dense"))
    rows = check_train.check(report)
    assert [r["row"] for r in rows][:2] == ["flashpar vs torch", "flashpar vs torch_dense"]
    pred = check_train.predict(report)
    assert pred["torch_dense"]["no_comm_s"] > pred["torch"]["no_comm_s"]


def test_check_runs_each_side_as_the_bench_ran_it():
    """The bench's torch and torch_dense run eager, torch_compile compiled; flashpar and baseline eager unless the
    report's setup says ``compile``."""
    from flashpar.sim.elementwise import compiled

    report = _report(names=("flashpar", "torch", "torch_compile", "torch_dense"))
    for name, want in (("flashpar", False), ("baseline", False), ("torch", False), ("torch_dense", False),
                       ("torch_compile", True)):
        assert compiled(check_train.workload(report, name), check_train.peer_of(name)) is want, name
    report["setup"]["compile"] = True
    assert compiled(check_train.workload(report, "flashpar"), PEERS["flashpar"]) is True
    report["setup"]["compile"] = "yes"
    with pytest.raises(ValueError, match="setup.compile"):
        check_train.workload(report, "flashpar")


def test_check_simulates_flashpar_compile_as_flashpar_compiled_and_compares_the_compiled_pairs():
    """bench train's ``flashpar_compile`` (the trainer with ``--compile``) is flashpar with its elementwise work fused:
    its predicted step is shorter than flashpar's eager one, and the check compares it with ``torch_compile``
    (compiled against compiled) and with ``flashpar`` (compilation's own gain)."""
    from flashpar.sim.elementwise import compiled

    report = _report(names=("flashpar", "flashpar_compile", "torch", "torch_compile"))
    assert compiled(check_train.workload(report, "flashpar_compile"), check_train.peer_of("flashpar_compile"))
    assert not compiled(check_train.workload(report, "flashpar"), check_train.peer_of("flashpar"))
    pred = check_train.predict(report)
    assert pred["flashpar_compile"]["no_comm_s"] < pred["flashpar"]["no_comm_s"]
    rows = {(r["row"], r["figure"]) for r in check_train.check(report)}
    for pair in ("flashpar_compile vs torch_compile", "flashpar_compile vs flashpar", "flashpar vs torch"):
        assert (pair, "tokens/s ratio") in rows and (pair, "tokens/s ratio, comm model") in rows, rows

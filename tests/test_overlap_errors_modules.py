"""Bad input, missing peers, sequence-parallel modules and DeviceMesh groups, on gloo at N = 1..4."""

from __future__ import annotations

import pytest

from dist_harness import SpawnCache, run_ranks
from overlap_workers import device_mesh, error_cases, missing_peer, mlp_modules, uneven_features

LOCAL_ERRORS = {  # raised on the rank itself before any communication, with these words in the message
    "unknown_mode": ("ValueError", "unknown mode 'fast'"),
    "feature_mismatch": ("ValueError", "input features 8"),
    "bad_chunks": ("ValueError", "chunks must be a positive int"),
    "split_not_add_up": ("ValueError", "add up to"),
    "not_divisible": ("ValueError", "not divisible by the group size"),
    "devices": ("ValueError", "different devices"),
    "dtypes": ("ValueError", "different dtypes"),
    "bad_peers_per_piece": ("ValueError", "all_gather_matmul: peers_per_piece must be an integer >= 1, got 0"),
    "peers_per_piece_ring": ("ValueError", "merges the pieces of mode 'flash' only, not of mode 'ring'"),
    "peers_per_piece_chunks": ("ValueError", "takes whole blocks: chunks must be 1, got 2"),
    "peers_per_piece_auto": ("ValueError", "mode 'auto' chooses peers_per_piece itself"),
}


MLP_MODES = ["flash", "ring", "slice", "none", "auto"]


def _calls(n: int) -> list[tuple]:
    calls = [("errors", error_cases), ("mlp", mlp_modules, MLP_MODES)]
    calls += [("uneven", uneven_features)] * (n == 4)
    return calls + [("mesh", device_mesh)] * (n in (2, 4))  # last: it destroys groups


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(_calls)  # one spawn per world size for the tests below (not the missing-peer ones)


@pytest.fixture(scope="module", params=[1, 2, 3, 4])
def errors(request, spawned):
    return request.param, spawned(request.param)["errors"]


def test_local_errors_are_clear_on_every_rank(errors):
    n, per_rank = errors
    for r, out in enumerate(per_rank):
        for name, (etype, words) in LOCAL_ERRORS.items():
            if name == "not_divisible" and n == 1:
                assert out[name] == "ok", "any length splits over one rank"
                continue
            assert out[name].startswith(etype) and words in out[name], f"N={n} rank {r} {name}: {out[name]}"
            assert "\n" not in out[name], f"{name}: one line"
        assert out["healthy_after"] == "ok", out["healthy_after"]


def test_cross_rank_mismatches_raise_everywhere(errors):
    n, per_rank = errors
    if n == 1:
        pytest.skip("needs peers")
    for r, out in enumerate(per_rank):
        if r == 1:
            assert out["one_rank_bad"].startswith("ValueError"), out["one_rank_bad"]
        else:
            assert out["one_rank_bad"].startswith("RuntimeError") and "rank(s) [1]" in out["one_rank_bad"]
        assert out["features_differ"].startswith("RuntimeError") and "features" in out["features_differ"]
        assert out["mid_shape_differs"].startswith("RuntimeError") and "middle shape" in out["mid_shape_differs"]
        assert out["dtype_differs"].startswith("RuntimeError") and "dtype" in out["dtype_differs"]
        assert "rank(s) [0]" in out["split_sizes_wrong"] or r == 0, out["split_sizes_wrong"]
        assert out["rs_split_differs"].startswith("RuntimeError") and "split_sizes" in out["rs_split_differs"]
        assert out["rs_seq_differs"].startswith(("RuntimeError", "ValueError")), out["rs_seq_differs"]
    assert per_rank[0]["split_sizes_wrong"].startswith("ValueError")


@pytest.mark.parametrize("check", [True, False], ids=["shape-check", "no-check"])
def test_missing_peer_times_out_with_a_clear_error(check):
    msg = run_ranks(2, missing_peer, check, timeout=60)[0]
    assert msg.startswith(("RuntimeError", "LaneError")), msg  # LaneError is a RuntimeError
    assert "all_gather_matmul" in msg and "rank 0" in msg and "timed out" in msg.lower(), msg
    if not check:
        assert "rank 1" in msg, "the error names the peer"
    seconds = float(msg.rsplit("[after ", 1)[1].rstrip("s]"))
    assert seconds < 5.0, f"the 2 s timeout took {seconds}s"


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_parallel_mlp_matches_full_model(spawned, n):
    per_rank = spawned(n)["mlp"]
    failures = {(r, mode): p for r, out in enumerate(per_rank) for mode, p in out.items() if p is not None}
    assert not failures, failures


def test_feature_split_must_divide(spawned):
    per_rank = spawned(4)["uneven"]
    assert all(out.startswith("ValueError") and "not divisible by the tensor-parallel size 4" in out
               for out in per_rank), per_rank


@pytest.mark.parametrize("n", [2, 4])
def test_device_mesh_groups(spawned, n):
    per_rank = spawned(n)["mesh"]
    for r, out in enumerate(per_rank):
        assert out["1d_mesh"] == "ok", (r, out)
        assert n != 2 or out["group_lifetime"] == "ok", (r, out)
        if n == 4:
            assert out["2d_mesh_rejected"].startswith("ValueError") and "1-D" in out["2d_mesh_rejected"], out
            assert out["sub_mesh"] == "ok", (r, out)

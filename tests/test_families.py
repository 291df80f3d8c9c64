"""The families of ``flashpar.models.families`` (biases, q/k norm, head_dim apart from hidden / heads, YaRN and linear
rope, a vocabulary padded to a multiple of tp) on every parallel layout: the parallel model in float64 against the
float64 single-process model, loss and every gradient; the config rows, the layout table and the rope math."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dist_harness import SpawnCache
from families_workers import FAMILY_MODELS, float64_cases
from flashpar.models import LlamaConfig
from flashpar.models.layout import LAYOUT, layout_of, mesh_name, padded_vocab
from flashpar.models.rope import inverse_frequencies, table_scale
from flashpar.models.rope_scaling import YarnScaling

# (dp, cp, ulysses, tp), dp mode, model (families_workers.FAMILY_MODELS), by world size: every family feature on
# tp (3 included), cp, Ulysses and ZeRO-3 over dp x cp x ulysses
CASES = {
    1: [((1, 1, 1, 1), "zero3", "qwen3-bias"), ((1, 1, 1, 1), "zero3", "yarn"), ((1, 1, 1, 1), "zero3", "linear"),
        ((1, 1, 1, 1), "zero3", "mistral-w5")],
    2: [((1, 1, 1, 2), "zero3", "linear"), ((1, 1, 1, 2), "replicate", "vocab61-untied"),
        ((1, 1, 2, 1), "zero3", "qwen2"), ((1, 2, 1, 1), "zero3", "qwen3"), ((1, 2, 1, 1), "zero3", "mistral-w5"),
        ((1, 1, 2, 1), "zero3", "qwen2-mixed")],
    3: [((1, 1, 1, 3), "zero3", "heads6-vocab13"), ((1, 1, 3, 1), "zero3", "heads6-vocab13"),
        ((3, 1, 1, 1), "zero3", "qwen2"), ((1, 3, 1, 1), "zero3", "yarn-mscale"),
        ((1, 3, 1, 1), "zero3", "qwen2-mixed")],
    4: [((1, 2, 1, 2), "zero3", "qwen3-bias"), ((1, 1, 1, 4), "replicate", "vocab61"),
        ((2, 1, 1, 2), "zero3", "vocab61-untied"), ((1, 1, 4, 1), "zero3", "qwen3-bias"),
        ((1, 2, 2, 1), "replicate", "llama-mlp-bias"), ((1, 1, 1, 4), "zero3", "vocab7"),
        ((2, 1, 1, 2), "zero3", "yarn"), ((1, 4, 1, 1), "zero3", "qwen2-mixed"),
        ((1, 2, 1, 2), "zero3", "mistral-w5"), ((2, 2, 1, 1), "replicate", "mistral-w5")],
}
IDS = [(n, case) for n, cases in CASES.items() for case in cases]
# float64 throughout: the mesh only reorders sums, measured <= 1e-14 relative; a bias added tp times, a q/k norm
# on the wrong features, YaRN's scale missing or a padded logit in the loss are O(1e-2) or more
TOL64 = 1e-10


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(lambda n: [("cases", float64_cases, CASES[n])], timeout=600.0)


@pytest.mark.parametrize("n, case", IDS, ids=[f"{n}-{c[0]}-{c[1]}-{c[2]}" for n, c in IDS])
def test_parallel_family_matches_single_process_in_float64(spawned, n, case):
    cfg = FAMILY_MODELS[case[2]]
    for rank, out in enumerate(spawned(n)["cases"]):
        errors = out[CASES[n].index(case)]
        bad = {k: v for k, v in errors.items() if not v <= TOL64}
        assert not bad, (rank, bad)
        # the loss and every single-process parameter (biases and q/k norms included)
        from flashpar.models.hf import expected_shapes

        assert len(errors) == 1 + len(expected_shapes(cfg)), sorted(errors)


def test_config_rows_refuse_features_a_family_does_not_have():
    with pytest.raises(ValueError, match="qk_norm do not fit family 'qwen2'"):
        LlamaConfig(family="qwen2", qkv_bias=True, qk_norm=True)
    with pytest.raises(ValueError, match="qkv_bias / o_bias do not fit family 'llama'"):
        LlamaConfig(qkv_bias=True)
    with pytest.raises(ValueError, match="family = 'gpt2' is not one of"):
        LlamaConfig(family="gpt2")
    cfg = FAMILY_MODELS["qwen3-bias"]
    # a checkpoint's meta.json written before the family fields existed reads as plain Llama
    old = {k: v for k, v in LlamaConfig().to_dict().items() if k not in ("family", "qkv_bias", "o_bias", "mlp_bias",
                                                                         "qk_norm", "windows")}
    assert LlamaConfig(**old) == LlamaConfig() and LlamaConfig(**cfg.to_dict()) == cfg


def test_windows_band_the_single_process_model():
    """The reference's band: a window as long as every document is full attention, and a window of 1 makes each
    token attend to itself only (the output does not depend on the earlier tokens of its document)."""
    from flashpar.models import Llama

    torch.manual_seed(0)
    full = Llama(FAMILY_MODELS["qwen2"]).double()
    lens = [9, 4, 12]
    tokens = torch.randint(0, 64, (sum(lens),))
    wide = Llama(dataclasses.replace(FAMILY_MODELS["qwen2"], windows=(12, 12))).double()
    wide.load_state_dict(full.state_dict())
    assert torch.equal(wide(tokens, lens), full(tokens, lens))
    one = Llama(dataclasses.replace(FAMILY_MODELS["qwen2"], windows=(1, 1))).double()
    one.load_state_dict(full.state_dict())
    changed = tokens.clone()
    changed[0] = (tokens[0] + 1) % 64
    a, b = one(tokens, lens), one(changed, lens)
    assert torch.equal(a[1:], b[1:]) and not torch.equal(a[0], b[0])
    assert not torch.equal(full(tokens, lens)[1:], full(changed, lens)[1:])


def test_layout_rows_of_biases_and_norms_name_their_single_process_parameters():
    assert layout_of("blocks.1.qkv_bias.bias")[1] == ["blocks.1.q_proj.bias", "blocks.1.k_proj.bias",
                                                     "blocks.1.v_proj.bias"]
    assert layout_of("blocks.1.down_bias.bias")[1] == ["blocks.1.down.bias"]
    assert mesh_name("blocks.0.k_proj.bias") == "blocks.0.qkv_bias.bias"
    assert mesh_name("blocks.0.k_proj.weight") == "blocks.0.qkv.weight"
    assert mesh_name("blocks.0.q_norm.weight") == "blocks.0.q_norm.weight"
    # biases and norms: no weight decay, never split over ZeRO-3's shard group
    assert [k for k, lay in LAYOUT.items() if lay.decays] == ["embed", "qkv", "o_proj", "gate_up", "down", "head"]
    assert not any(LAYOUT[k].zero_rows(True) for k in ("qkv_bias", "gate_up_bias", "o_bias", "q_norm"))
    assert [padded_vocab(v, tp) for v, tp in ((61, 4), (64, 4), (7, 3), (5, 1))] == [64, 64, 9, 5]
    # tp 4 of a vocabulary of 61: rows 48..63, three of them padding, zeros
    full = torch.arange(61.0)[:, None]
    piece = LAYOUT["embed"].tp_pieces([(61, 1)], 3, 4)[0]
    assert piece.of(full).flatten().tolist() == [*range(48, 61), 0, 0, 0]


def test_yarn_frequencies_follow_the_ramp_and_scale_the_tables():
    """YaRN's frequencies at its two ends (unchanged below lo, divided by the factor above hi) and its attention
    factor, against the formulas of flashpar.models.rope's docstring worked by hand (float64)."""
    d, theta, s, big = 32, 10000.0, 4.0, 64
    cfg = LlamaConfig(hidden=128, heads=4, kv_heads=2, rope_theta=theta,
                      rope_scaling=YarnScaling(factor=s, original_max_position_embeddings=big))
    plain = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    got = inverse_frequencies(cfg)

    def pair(turns):
        return d * math.log(big / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = max(math.floor(pair(32)), 0), min(math.ceil(pair(1)), d - 1)
    for i in range(d // 2):
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        assert float(got[i]) == pytest.approx(float(plain[i]) * (1 - ramp + ramp / s), rel=1e-15)
    assert table_scale(cfg) == pytest.approx(0.1 * math.log(s) + 1)
    mscaled = dataclasses.replace(cfg, rope_scaling=YarnScaling(factor=s, original_max_position_embeddings=big,
                                                                mscale=2.0, mscale_all_dim=1.0))
    assert table_scale(mscaled) == pytest.approx((0.2 * math.log(s) + 1) / (0.1 * math.log(s) + 1))

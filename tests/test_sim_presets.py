"""The models ``flashpar simulate`` knows by name are their published shapes: every family's preset reads through
the same ``LlamaConfig.from_hf`` path as a user's config.json, with the parameter count the publisher states."""

from __future__ import annotations

import pytest

from flashpar.cli import main
from flashpar.sim.elementwise import label
from flashpar.sim.model_configs import SHIPPED, load_model

# name -> (family, parameters the model card states, in billions; its rounding: the tolerance)
PUBLISHED = {
    "llama3-8b": ("llama", 8.03, 0.005),
    "llama3-70b": ("llama", 70.6, 0.05),
    "qwen3-8b": ("qwen3", 8.2, 0.05),
    "qwen3-32b": ("qwen3", 32.8, 0.05),
    "qwen2.5-7b": ("qwen2", 7.61, 0.01),  # the card's 7.61 B truncates 7.6156
    "mistral-7b": ("mistral", 7.25, 0.005),
}


def test_every_preset_is_listed_with_its_published_size():
    assert set(SHIPPED) == set(PUBLISHED)
    for name, (family, billions, rounding) in PUBLISHED.items():
        cfg = load_model(name)
        assert cfg.family == family, name
        assert abs(cfg.params / 1e9 - billions) <= rounding, (name, cfg.params)
    qwen3, qwen2 = load_model("qwen3-32b"), load_model("qwen2.5-7b")
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.heads * qwen3.head_dim == 8192 != qwen3.hidden
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm


@pytest.mark.parametrize(("name", "tp"), [("qwen3-8b", 8), ("qwen3-32b", 8), ("qwen2.5-7b", 4), ("mistral-7b", 8)])
def test_simulate_train_runs_each_family(name, tp, capsys):
    """(Qwen2.5-7B's 28 heads and 4 kv heads split over tp 4 at most.)"""
    assert main(["simulate", "train", "--model", name, "--gpus", "64", "--tp", str(tp), "--seq", "8192"]) == 0
    out = capsys.readouterr().out
    assert "flashpar" in out and "torch" in out
    assert label(True) in out.splitlines()  # the presets compare compiled with compiled, and say so


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_family_costs_flashpar_more_eager_than_compiled(name):
    """Every preset's flashpar block moves more elementwise bytes and launches more kernels without --compile
    (its RMSNorm op by op, rope's halves, and the family's bias adds and qk-norm) than compiled."""
    from flashpar.cost import preset
    from flashpar.sim import elementwise
    from flashpar.sim.peers import PEERS
    from flashpar.sim.topology import Cluster, Layout
    from flashpar.sim.workload import Workload

    w = Workload(load_model(name), Layout(8, 1, 1, 1), Cluster(preset("h100-96gb"), preset("h100-ib")), ((8192,),))
    eager = Workload(w.cfg, w.layout, w.cluster, w.packs, flashpar_compiled=False)
    fp = PEERS["flashpar"]
    assert elementwise.elementwise_bytes(eager, fp) > 2 * elementwise.elementwise_bytes(w, fp)
    assert elementwise.kernels(eager, fp)[0] > elementwise.kernels(w, fp)[0]

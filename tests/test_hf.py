"""Hugging Face Llama folders in and out (``flashpar.models.hf``), against ``transformers``' ``LlamaForCausalLM``.

The folders are tiny random models written by transformers in this process (the spawned ranks of the
parallel checks never import it).  Their norm weights are randomised too (transformers starts them at
one, where swapping the two norms of a block could not be seen), and the weights are wide enough
(std 0.1) that the rotary frequencies show in the logits: the old reading of a transformers-5 config
(``rope_theta`` 10000, no llama3 scaling) moves them by more than 1e-3 relative here, a hundred times
the tolerance.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dist_harness import run_ranks
from flashpar.models import Llama, LlamaConfig, RopeScaling, load_hf, save_hf
from flashpar.models.hf import WeightFiles, hf_name
from hf_workers import slices_on_meshes

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
DEFAULT = {"rope_type": "default", "rope_theta": 500000.0}
DOCS = [17, 1, 40, 9]  # a packed sequence; each document also alone
# fp32 against fp32: the same ops in another order (and transformers' fp32 rope frequencies, ours fp64:
# angle error p f 6e-8 < 1e-5 at these positions); measured ~3e-7.  One wrong tensor or frequency is >1e-3.
RTOL = 1e-5


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def randomise_norms(model: torch.nn.Module, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))


def hf_folder(transformers, path, *, rope=DEFAULT, tied=False, sharded=False, vocab=64, hidden=32, heads=4,
              kv_heads=2, ffn=64, head_dim=None, seed=0):
    """A random ``LlamaForCausalLM`` saved by transformers at ``path`` (sharded: several files and an index)."""
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                                   rope_parameters=dict(rope), max_position_embeddings=256, rms_norm_eps=1e-6,
                                   tie_word_embeddings=tied, initializer_range=0.1)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    randomise_norms(model, seed + 1)
    model.save_pretrained(path, max_shard_size="20KB" if sharded else "5GB")
    return model


def hf_logits(model, docs: list[torch.Tensor]) -> torch.Tensor:
    """transformers' logits of each document alone (positions from 0), concatenated."""
    with torch.no_grad():
        return torch.cat([model(d[None], use_cache=False).logits[0] for d in docs])


def ours(model: Llama, docs: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.cat(docs), [len(d) for d in docs])


@pytest.mark.parametrize("rope, tied, sharded", [(DEFAULT, True, False), (DEFAULT, False, True),
                                                 (LLAMA3, True, True), (LLAMA3, False, False)],
                         ids=["default-tied", "default-untied-sharded", "llama3-tied-sharded", "llama3-untied"])
def test_load_hf_logits_equal_transformers(transformers, tmp_path, rope, tied, sharded):
    hf = hf_folder(transformers, tmp_path, rope=rope, tied=tied, sharded=sharded)
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded
    model = load_hf(tmp_path)
    assert model.cfg.rope_theta == 500000.0 and model.cfg.rope_type == rope["rope_type"]
    assert (model.head is None) == tied and model.embed.weight.dtype == torch.float32
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 64, (n,), generator=gen) for n in DOCS]
    single = [torch.cat(docs)]  # one document of 67 tokens
    for case in (single, docs):
        want = hf_logits(hf, case)
        assert rel(ours(model, case), want) <= RTOL
    # the test can fail: the old reading (theta 10000, no scaling) and a plain rope both miss by far
    for wrong in ({"rope_theta": 10000.0, "rope_scaling": None}, {"rope_scaling": None}):
        if model.cfg.rope_scaling is None and "rope_theta" not in wrong:
            continue
        other = Llama(dataclasses.replace(model.cfg, **wrong))
        other.load_state_dict(model.state_dict())
        assert rel(ours(other, docs), want) > 1e-3


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_save_hf_round_trip_through_transformers(transformers, tmp_path, tied):
    cfg = LlamaConfig(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, rope_theta=500000.0,
                      norm_eps=1e-6, tie_embeddings=tied, init_std=0.1, max_positions=512,
                      rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                               original_max_position_embeddings=32))
    torch.manual_seed(0)
    model = Llama(cfg)
    randomise_norms(model)
    save_hf(model, tmp_path)
    hf, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert hf.config.tie_word_embeddings == tied and hf.config.rope_parameters["rope_type"] == "llama3"
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 64, (n,), generator=gen) for n in DOCS]
    assert rel(ours(model, docs), hf_logits(hf.eval(), docs)) <= RTOL
    assert LlamaConfig.from_hf(tmp_path) == cfg
    back = load_hf(tmp_path)
    assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in back.named_parameters())


def test_from_hf_reads_rope_theta_wherever_transformers_writes_it(tmp_path):
    base = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 64, "model_type": "llama", "max_position_embeddings": 4096}
    cases = [({"rope_theta": 500000.0}, None),  # transformers 4
             ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, None),  # transformers 5
             ({"rope_theta": 500000.0, "rope_scaling": {k: v for k, v in LLAMA3.items() if k != "rope_theta"}},
              32),  # transformers 4, llama 3.1
             ({"rope_parameters": {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}},
              4096)]  # no original length: max_position_embeddings, as transformers does
    for extra, original in cases:
        (tmp_path / "config.json").write_text(json.dumps({**base, **extra}))
        cfg = LlamaConfig.from_hf(tmp_path)
        assert cfg.rope_theta == 500000.0 and cfg.max_positions == 4096, extra
        if original is None:
            assert cfg.rope_scaling is None
        else:
            assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, original)
        assert LlamaConfig(**json.loads(json.dumps(cfg.to_dict()))) == cfg  # meta.json round trip


BASE = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 64, "model_type": "llama", "rope_parameters": DEFAULT}


@pytest.mark.parametrize("edit, words", [
    ({"model_type": "gemma"}, "model_type = 'gemma' is not supported"),
    ({"model_type": "mistral", "attention_bias": True}, "attention_bias = true is not supported for model_type"),
    ({"model_type": "qwen2", "mlp_bias": True}, "mlp_bias = true is not supported for model_type 'qwen2'"),
    ({"attention_bias": 1}, "attention_bias = 1 is not true or false"),
    ({"model_type": "qwen2", "use_sliding_window": True, "layer_types": ["full_attention"]},
     "layer_types = .* is not 2 of"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}},
     "rope_parameters.rope_type = 'longrope' is not supported"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_scaling.rope_type = 'dynamic' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "low_freq_factor": 1.0}},
     "rope_parameters.low_freq_factor is not supported for rope_type 'yarn'"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "rope_parameters lacks 'factor'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     "rope_parameters lacks 'low_freq_factor'"),
    ({"rope_parameters": {**LLAMA3, "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
     "rope_parameters: high_freq_factor .* must exceed low_freq_factor"),
    ({"rope_parameters": {**LLAMA3, "factor": "8"}}, "rope_parameters: factor must be a positive number"),
    ({"rope_theta": 1e4}, "rope_theta disagrees"),
    ({"rope_parameters": "fast"}, "rope_parameters = 'fast' is not a JSON object"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5 is not supported"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers = 2.5 is not an integer"),
    ({"intermediate_size": None}, "intermediate_size = None is not an integer"),
])
def test_from_hf_refuses_what_flashpar_does_not_implement_in_one_line(tmp_path, edit, words):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **edit}))
    with pytest.raises(ValueError, match=words) as err:
        LlamaConfig.from_hf(tmp_path)
    assert "\n" not in str(err.value) and str(tmp_path) in str(err.value)


def _tiny(tied=False) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=64, hidden=32, layers=1, heads=4, kv_heads=2, ffn=48, tie_embeddings=tied))


def test_weights_that_do_not_fit_the_config_are_named_in_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    model = _tiny()
    save_hf(model, tmp_path)
    weights = tmp_path / "model.safetensors"
    good = load_file(weights)
    for change, words in [(lambda t: t.pop("model.layers.0.mlp.up_proj.weight"),
                           "missing model.layers.0.mlp.up_proj.weight"),
                          (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(32)}),
                           "unexpected model.layers.0.self_attn.q_proj.bias"),
                          (lambda t: t.update({"model.norm.weight": torch.ones(31)}),
                           r"mis-shaped model.norm.weight \[31\] \(expected \[32\]\)")]:
        tensors = dict(good)
        change(tensors)
        save_file(tensors, weights)
        with pytest.raises(ValueError, match="the weights do not fit config.json: " + words) as err:
            load_hf(tmp_path)
        assert "\n" not in str(err.value)
    weights.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read the safetensors file model.safetensors"):
        load_hf(tmp_path)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json in"):
        load_hf(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="lists files that are not there: gone.safetensors"):
        load_hf(tmp_path)
    save_hf(model, tmp_path)  # removes the stale index
    other = dataclasses.replace(model.cfg, ffn=64)
    with pytest.raises(ValueError, match="config.json is another model \\(ffn differ: ffn 48 != 64\\)"):
        WeightFiles(tmp_path, other)


def test_a_tied_folder_may_keep_its_lm_head_and_dtype_follows_the_file(tmp_path):
    """Some writers store ``lm_head.weight`` of a tied model (equal to the embedding): it is skipped."""
    from safetensors.torch import load_file, save_file

    model = _tiny(tied=True).to(torch.bfloat16)
    save_hf(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    head = tensors["model.embed_tokens.weight"].clone()
    save_file({**tensors, "lm_head.weight": head}, tmp_path / "model.safetensors")
    back = load_hf(tmp_path)
    assert back.embed.weight.dtype == torch.bfloat16 and back.head is None
    assert torch.equal(back.embed.weight, model.embed.weight)
    assert load_hf(tmp_path, dtype=torch.float64).norm.weight.dtype == torch.float64
    assert hf_name("blocks.1.gate.weight") == "model.layers.1.mlp.gate_proj.weight"


def test_init_from_takes_the_sizes_from_the_folder_and_refuses_disagreeing_flags(tmp_path):
    import argparse

    from flashpar.train.config import add_arguments, from_args

    save_hf(_tiny(), tmp_path)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = from_args(parser.parse_args(["--init-from", str(tmp_path), "--tp", "2", "--hidden", "32"]))
    assert config.model == LlamaConfig.from_hf(tmp_path) and config.init_from == str(tmp_path)
    with pytest.raises(ValueError, match="has hidden 32, ffn 48 but --hidden 48, --ffn 64 was given"):
        from_args(parser.parse_args(["--init-from", str(tmp_path), "--hidden", "48", "--ffn", "64"]))


@pytest.mark.parametrize("tp, dp", [(1, 3), (2, 2), (3, 4)])
def test_pieces_are_the_zero3_rows_of_every_tp_shard(tp, dp):
    """``layout.pieces`` with dp rows (what a rank reads from a folder) is the old cut: rows
    ``shard_rows(R_t, dp, d)`` of tp rank t's shard (what ``shard_of`` took), for every parameter, including
    cuts inside one part of a fused weight (dp 3 and 4 on q/k/v rows 12 D + 2 x 4 D)."""
    from flashpar.models.layout import layout_of, mesh_name, stack
    from flashpar.rows import shard_rows

    cfg = LlamaConfig(vocab_size=96, hidden=48, heads=12, kv_heads=6, head_dim=4, ffn=60, layers=1,
                      tie_embeddings=False)
    full = {n: p.detach() for n, p in Llama(cfg).named_parameters()}
    for name in sorted({mesh_name(n) for n in full}):
        layout, names = layout_of(name)
        shapes = [full[n].shape for n in names]
        for t in range(tp):
            shard = layout.shard([full[n] for n in names], t, tp)
            for d in range(dp):
                pieces = layout.pieces(shapes, t, tp, (d, dp) if layout.zero_rows(True) else None)
                got = stack(pieces, lambda p, names=names: p.of(full[names[p.part]]))
                lo, hi = shard_rows(shard.shape[0], dp, d) if layout.zero_rows(True) else (0, shard.shape[0])
                assert torch.equal(got, shard[lo:hi]), (name, t, d)


# ---- the mesh model from a folder, each rank reading its slices (spawned ranks) ------------------------------

PARALLEL = {"hidden": 48, "heads": 6, "kv_heads": 2, "head_dim": 8, "ffn": 72, "vocab": 256}  # byte tokens
# the first case of each world is pure ZeRO-3 over dp = world (the bytes read add up as below); the cut of the
# dp rows inside each tp shard for tp > 1 is test_pieces_are_the_zero3_rows_of_every_tp_shard's
WORLD2 = [((2, 1, 1, 1), "zero3"),  # dp 2: the rows of cat(q, k, v) (48 + 16 + 16) cut inside q
          ((1, 1, 1, 2), "zero3"),  # tp 2: head / embedding vocabulary rows, o_proj / down columns
          ((1, 1, 2, 1), "zero3")]  # Ulysses: whole attention weights on every rank
WORLD3 = [((3, 1, 1, 1), "zero3")]  # dp 3: 80 rows cut inside q and inside k, gate/up's 144 inside up
CASES = {2: WORLD2, 3: WORLD3}


@pytest.fixture(scope="module")
def folders(transformers, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-parallel")
    hf_folder(transformers, root / "tied", rope=LLAMA3, tied=True, **PARALLEL)
    untied = hf_folder(transformers, root / "untied", rope=LLAMA3, tied=False, sharded=True, **PARALLEL)
    return root, untied


@pytest.fixture(scope="module")
def world2(folders):
    return run_ranks(2, slices_on_meshes, str(folders[0] / "untied"), WORLD2, str(folders[0] / "checkpoints"),
                     timeout=300.0)


@pytest.fixture(scope="module")
def world3(folders):
    return run_ranks(3, slices_on_meshes, str(folders[0] / "tied"), WORLD3, None, timeout=300.0)


@pytest.mark.parametrize("world", [2, 3])
def test_parallel_model_from_slices_matches_the_single_process_model(world, folders, request):
    """Each rank read exactly the bytes of its parameters (counted at the reader); gathered they are the
    folder's tensors bit for bit; one step (loss and every gradient) matches ``load_hf``'s model to
    ``flashpar.train.check.TOL`` (fp32, only the order of sums changes: 1e-4, measured ~1e-6).  Under pure
    ZeRO-3 the ranks together read the model once plus, per extra rank, what ZeRO-3 keeps whole (the
    norms): no rank reads rows it does not hold."""
    per_rank = request.getfixturevalue(f"world{world}")
    tied = world == 3
    for rank, results in enumerate(per_rank):
        for (shape, _), (read, held, exact, bad, count) in zip(CASES[world], results, strict=True):
            assert read == held > 0, (shape, rank, read, held)
            assert exact, (shape, rank)
            assert not bad and count == 1 + 2 * 9 + 2 + (not tied), (shape, rank, bad)
    ref = load_hf(folders[0] / ("tied" if tied else "untied"))
    size = {n: p.numel() * p.element_size() for n, p in ref.named_parameters()}
    whole_everywhere = sum(b for n, b in size.items() if "norm" in n)
    assert sum(results[0][0] for results in per_rank) == sum(size.values()) + (world - 1) * whole_everywhere


def test_export_of_a_checkpoint_loads_in_transformers(transformers, folders, world2, tmp_path, capsys):
    from flashpar.cli import main
    from flashpar.train import checkpoint

    root, original = folders
    assert main(["export", str(root / "checkpoints"), "--hf", str(tmp_path / "out")]) == 0
    hf, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    want = dict(load_hf(root / "untied").named_parameters())  # saved as loaded: the same tensors
    assert all(torch.equal(p, want[n]) for n, p in load_hf(tmp_path / "out").named_parameters())
    docs = [torch.randint(0, 256, (n,)) for n in DOCS]
    assert rel(hf_logits(hf.eval(), docs), hf_logits(original, docs)) <= RTOL
    capsys.readouterr()
    assert main(["export", str(tmp_path / "nothing"), "--hf", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flashpar export: no checkpoint (flashpar.json) at") and "\n" not in err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "meta.json").write_text(json.dumps({"step": 1}))
    (tmp_path / "bad" / ".metadata").write_bytes(b"")
    assert main(["export", str(tmp_path / "bad"), "--hf", str(tmp_path / "x")]) == 2
    assert "has no flashpar.json" in capsys.readouterr().err  # refused before anything reads it
    checkpoint.trust(tmp_path / "bad")  # described as it is: export's own checks come next
    assert main(["export", str(tmp_path / "bad"), "--hf", str(tmp_path / "x")]) == 2
    assert "meta.json holds no valid model config" in capsys.readouterr().err
    (tmp_path / "bad" / "meta.json").write_text(json.dumps({"step": 1, "model": LlamaConfig().to_dict()}))
    (tmp_path / "bad" / checkpoint.MARKER).unlink()
    checkpoint.trust(tmp_path / "bad")
    assert main(["export", str(tmp_path / "bad"), "--hf", str(tmp_path / "x")]) == 2
    assert "is not a torch.distributed.checkpoint folder" in capsys.readouterr().err


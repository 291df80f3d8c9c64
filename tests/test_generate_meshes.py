"""Generation's options through the whole pipeline on (tp, cp) meshes: penalties, min-p, top-k, several outputs
per prompt, stop tokens and log-probabilities on tp 1 x cp 1, tp 2 x cp 1 and tp 1 x cp 2 against a
single-process float64 reference that recomputes every step from the whole sequence, and greedy choice with a
repetition penalty against transformers' ``generate``."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks
from flashpar.infer.penalties import History
from flashpar.infer.sampling import Sampling, choose, uniforms
from flashpar.infer.stopping import Stopping, finish
from infer_workers import MAX_NEW, cases, options_case, prompts

SETTINGS = {
    "greedy, repetition": {"repetition_penalty": 1.3},
    "greedy, all penalties": {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.3},
    "sampled": {"temperature": 0.9, "top_k": 20, "min_p": 0.05, "n": 2, "seed": 4, "repetition_penalty": 1.2,
                "presence_penalty": 0.2},
}
MESHES = {1: [(1, 1)], 2: [(2, 1), (1, 2)]}  # (tp, cp) by world size


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A random ``LlamaForCausalLM`` saved by transformers (vocabulary 64) and its greedy tokens with a repetition
    penalty of 1.3 for each prompt of ``prompts()``, each generated alone."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("hf-options")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    greedy = []
    with torch.no_grad():
        for p in prompts():
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=MAX_NEW, do_sample=False, repetition_penalty=1.3, eos_token_id=None,
                                 pad_token_id=0)
            greedy.append(out[0, len(p):].tolist())
    return str(path), greedy


def _reference(path, how: Sampling, stop_ids) -> tuple[list, list, list]:
    """Every output's (tokens, finish reason, log-probabilities) from the float64 single-process model: each step
    the whole sequence through the model, the penalties' history rebuilt from the prompt and the output so far,
    the output's own uniform number (output ``i * n + j``)."""
    from flashpar.models.hf import load_hf

    full = load_hf(path).double()
    rows = [p for p in prompts() for _ in range(how.n)]
    u = uniforms(how.generator_seed, MAX_NEW, len(rows))
    tokens, reasons, lps = [], [], []
    for k, p in enumerate(rows):
        seq, lp = list(p), []
        for s in range(MAX_NEW):
            with torch.no_grad():
                logits = full(torch.tensor(seq), [len(seq)])[-1:]
            history = History([p], 64, torch.device("cpu"), repetition=how.repetition_penalty != 1,
                              counted=how.frequency_penalty != 0 or how.presence_penalty != 0)
            for t in seq[len(p):]:
                history.add(torch.tensor([t]))
            one = torch.zeros(1, dtype=torch.float64)
            seq.append(int(choose(logits, u[s, k:k + 1], how, history, one)))
            lp.append(float(one))
        out, reason, _ = finish(seq[len(p):], Stopping(stop_ids=stop_ids), None)
        tokens.append(out)
        reasons.append(reason)
        lps.append(lp[: len(out)])
    return tokens, reasons, lps


@pytest.fixture(scope="module")
def runs(hf):
    """The references, a stop token for each setting (the third token of the reference's first output, so that
    some outputs stop early), and each mesh's outputs (one spawn per world size)."""
    path = hf[0]
    refs, items = {}, []
    for name, settings in SETTINGS.items():
        how = Sampling(**settings)
        free = _reference(path, how, ())
        stop = (free[0][0][2],)
        refs[name] = _reference(path, how, stop)
        items.append((path, settings, stop))
    got = {}
    for world, meshes in MESHES.items():
        per_rank = run_ranks(world, cases, options_case, [(m, *item) for m in meshes for item in items],
                             timeout=600.0)
        for rank, per_case in enumerate(per_rank):
            for i, result in enumerate(per_case):
                got[(meshes[i // len(items)], list(SETTINGS)[i % len(items)], rank)] = result
    return refs, got


@pytest.mark.parametrize("name", list(SETTINGS))
def test_every_mesh_gives_the_single_process_references_outputs(runs, name):
    """Tokens and finish reasons equal the reference's on every rank of every mesh; log-probabilities within 1e-4
    (the parallel model computes in fp32: its logits are within 1e-6 relative of the float64 model's,
    tests/test_infer.py, and a log-probability's error is of that order)."""
    refs, got = runs
    tokens, reasons, lps = refs[name]
    assert "stop" in reasons and "length" in reasons, reasons  # both ends exercised
    for (mesh, setting, rank), (g_tokens, g_reasons, g_lps) in got.items():
        if setting != name:
            continue
        assert g_tokens == tokens and g_reasons == reasons, (mesh, rank, g_tokens, tokens)
        worst = max(abs(a - b) for g, r in zip(g_lps, lps, strict=True) for a, b in zip(g, r, strict=True))
        assert worst < 1e-4, (mesh, rank, worst)
    if SETTINGS[name].get("n", 1) > 1:
        assert tokens[0] != tokens[1] or tokens[2] != tokens[3]  # a prompt's samples are drawn apart


def test_greedy_with_a_repetition_penalty_equals_transformers_generate(runs, hf):
    """Without stopping, the greedy outputs with ``repetition_penalty`` 1.3 equal transformers' ``generate``
    with the same penalty (its RepetitionPenaltyLogitsProcessor over prompt and output)."""
    refs, got = runs
    path = hf[0]
    free, _, _ = _reference(path, Sampling(**SETTINGS["greedy, repetition"]), ())
    assert free == hf[1]
    stopped, _, _ = refs["greedy, repetition"]
    for (mesh, setting, rank), (tokens, _, _) in got.items():
        if setting == "greedy, repetition":
            assert all(t == w[: len(t)] for t, w in zip(tokens, hf[1], strict=True)), (mesh, rank)
    assert stopped != hf[1]  # the stop token cut some outputs

"""Inference (``flashpar.infer``): packed prefill, the sharded KV cache and context-parallel decode on (tp, cp)
meshes against float64 single-process references and against transformers' own ``generate``."""

from __future__ import annotations

import math

import pytest
import torch

from dist_harness import SpawnCache
from flashpar.infer.attention import combine, partial_attention
from flashpar.infer.sampling import Sampling, choose, uniforms
from flashpar.models import LlamaConfig
from infer_workers import MAX_NEW, bad_input, cases, decode_case, generate_case, prefill_case, prompts

TIED = LlamaConfig(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64)  # default rope, tied
MESHES = {1: [(1, 1)], 2: [(1, 2), (2, 1)], 3: [(1, 3)], 4: [(2, 2)], 6: [(2, 3)]}  # (tp, cp) by world size
SAMPLED = {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 7}
TIED_WORLDS = (2, 6)  # the tied, default-rope model's prefill at these world sizes (the transformers folder: all)
SAMPLED_WORLDS = (1, 4, 6)  # sampling compared across these (tp, cp): (1, 1), (2, 2), (2, 3)
BAD = ["empty", "vocab", "long", "one rank"]
ONE = [2]  # one prompt of 2 tokens: at cp 3 a rank holds none of the batch


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A random ``LlamaForCausalLM`` saved by transformers (fp32, llama3 rope, untied) and its greedy tokens for
    each prompt of ``prompts()``, each generated alone with transformers' cache."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("hf")
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope,
                                   max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                   initializer_range=0.1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    greedy = []
    with torch.no_grad():
        for p in prompts() + prompts(ONE):
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=MAX_NEW, do_sample=False, use_cache=True, eos_token_id=None,
                                 pad_token_id=0)
            greedy.append(out[0, len(p):].tolist())
    return str(path), greedy


@pytest.fixture(scope="module")
def spawned(hf):
    path = hf[0]

    def calls(n):
        meshes = MESHES[n]
        sources = (path, TIED) if n in TIED_WORLDS else (path,)
        out = [("prefill", cases, prefill_case, [(m, src, strategy) for m in meshes for src in sources
                                                 for strategy in ("flashcp", "per_doc")]),
               ("decode", cases, decode_case, [(m, path, "flashcp") for m in meshes]
                + ([(m, path, "per_doc") for m in meshes] if n == 6 else [])),
               ("greedy", cases, generate_case, [(m, path, "flashcp", {}) for m in meshes]
                + [(m, path, "flashcp", {}, ONE) for m in meshes if m[1] == 3]),
               ("sampled", cases, generate_case, [(m, path, "flashcp", SAMPLED) for m in meshes
                                                  if n in SAMPLED_WORLDS])]
        if n == 4:
            out.append(("bad", cases, bad_input, [(MESHES[4][0], TIED, kind) for kind in BAD]))
        return out

    return SpawnCache(calls, timeout=600.0)


WORLDS = sorted(MESHES)


@pytest.mark.parametrize("n", WORLDS)
def test_prefill_logits_and_every_ranks_cache_match_the_float64_model(spawned, n):
    """Every prompt's last-token logits and each rank's cached K/V (its planned tokens, its tp rank's kv heads,
    every layer) against the float64 single-process model, llama3 rope (the transformers folder) and default
    rope (tied, at ``TIED_WORLDS``), flashcp (the long prompt split, the others whole) and per_doc (every prompt split).
    Tolerance 1e-4 relative: fp32 against float64 over two layers, measured below 1e-6; a K/V row in the
    wrong slot, a wrong head or position is O(1)."""
    for rank, per_case in enumerate(spawned(n)["prefill"]):
        sources = "ab" if n in TIED_WORLDS else "a"
        for (err_logits, err_cache, split, whole, held), (shape, _, strategy) in zip(
                per_case, [(m, s, st) for m in MESHES[n] for s in sources for st in ("flashcp", "per_doc")],
                strict=True):
            assert err_logits < 1e-4 and err_cache < 1e-4, (rank, shape, strategy, err_logits, err_cache)
            if shape[1] > 1 and strategy == "flashcp":
                assert split >= 1 and whole >= 1, (shape, split, whole)  # both decode paths are exercised
            if shape[1] > 1 and strategy == "per_doc":
                assert split >= 4, (shape, split)
            assert held > 0


@pytest.mark.parametrize("n", WORLDS)
def test_decode_logits_match_the_float64_model_and_appends_follow_the_schedule(spawned, n):
    """Every decode step's logits of every row a rank decodes against the float64 model run on the whole
    sequence so far (1e-4 relative, as prefill: measured below 1e-6); each rank's cached token counts at the
    end equal the schedule's (prefill + the appends it was given)."""
    for rank, per_case in enumerate(spawned(n)["decode"]):
        shapes = MESHES[n] + (MESHES[n] if n == 6 else [])  # world 6: flashcp, then per_doc
        for (worst, placed, split), shape in zip(per_case, shapes, strict=True):
            assert worst < 1e-4 and placed, (rank, shape, worst, placed)
            assert split >= 1 or shape[1] == 1, shape  # a prompt split over cp ranks combines its partials


@pytest.mark.parametrize("n", WORLDS)
def test_greedy_tokens_equal_transformers_generate(spawned, hf, n):
    """``generate`` (greedy) on every mesh gives transformers' greedy tokens for every prompt of the mixed batch,
    on every rank; the cp ranks of a tp index hold every token's K/V once between them (the prompts and the
    ``MAX_NEW - 1`` fed-back tokens of each), and nothing more."""
    greedy = hf[1]
    per_rank = spawned(n)["greedy"]
    for rank, per_case in enumerate(per_rank):
        for (tokens, kv_bytes, kv_tokens), shape in zip(per_case, MESHES[n], strict=False):
            assert tokens == greedy[:-1], (rank, shape, tokens, greedy)
            assert kv_bytes > 0 and kv_tokens > 0
    for i, (tp, cpn) in enumerate(MESHES[n]):
        held = [per_rank[r][i][2] for r in range(0, tp * cpn, tp)]  # the cp ranks of tp index 0 (ranks c tp)
        assert sum(held) == sum(len(p) for p in prompts()) + len(prompts()) * (MAX_NEW - 1), (tp, cpn, held)
        if MESHES[n][0][1] == 3:  # the single short prompt: ranks without any of it still take part
            tokens, _, _ = per_case[-1]
            assert tokens == greedy[-1:], (rank, tokens, greedy[-1])


@pytest.mark.parametrize("n", SAMPLED_WORLDS)
def test_the_same_seed_samples_the_same_tokens_on_every_mesh(spawned, n):
    """Temperature, top-k and top-p with one seed: the tokens on every mesh equal the single rank's."""
    one = spawned(1)["sampled"][0][0][0]
    for rank, per_case in enumerate(spawned(n)["sampled"]):
        for tokens, _, _ in per_case:
            assert tokens == one, (rank, tokens, one)
    assert one != spawned(1)["greedy"][0][0][0]  # the sampler did sample


def test_bad_input_raises_one_line_on_every_rank(spawned):
    """An empty prompt, a token outside the vocabulary, a prompt too long for the positions, and a bad prompt
    on one rank only: every rank raises one line (no hang)."""
    per_rank = spawned(4)["bad"]
    for kind, lines in zip(BAD, zip(*per_rank, strict=True), strict=True):
        assert all(line and "\n" not in line for line in lines), (kind, lines)
        if kind != "one rank":
            assert len(set(lines)) == 1, (kind, lines)
    assert "empty" in per_rank[0][0] and "outside the vocabulary" in per_rank[0][1]
    assert "positions" in per_rank[0][2] and "rejected" in per_rank[1][3]


def _full_attention(q, k, v, scale):
    """Softmax attention of ``q [H, D]`` over ``k, v [L, H_kv, D]`` (grouped-query)."""
    group = q.shape[0] // k.shape[1]
    s = torch.einsum("hd,lhd->hl", q, k.repeat_interleave(group, 1)) * scale
    return torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v.repeat_interleave(group, 1))


@pytest.mark.parametrize("parts", [[5], [3, 0, 7], [1, 1, 1, 9], [0, 4]])
def test_combine_of_partials_equals_attention_over_the_whole_cache(parts):
    """The keys of one query split over ranks (``parts``: keys per rank, 0: a rank holding none); each rank's
    ``partial_attention`` and the log-sum-exp ``combine`` equal softmax attention over all the keys, float64
    (1e-12: only reordered sums)."""
    torch.manual_seed(len(parts))
    heads, kv, d, total = 4, 2, 8, sum(parts)
    q = torch.randn(1, heads, d, dtype=torch.float64)
    k = 3 * torch.randn(total, kv, d, dtype=torch.float64)
    v = torch.randn(total, kv, d, dtype=torch.float64)
    want = _full_attention(q[0], k, v, d ** -0.5)
    width = max(parts)
    os, lses, at = [], [], 0
    for n in parts:
        kk = torch.zeros(1, width, kv, d, dtype=torch.float64)
        vv = torch.zeros(1, width, kv, d, dtype=torch.float64)
        kk[0, :n], vv[0, :n] = k[at:at + n], v[at:at + n]
        valid = torch.arange(width)[None] < n
        o, lse = partial_attention(q, kk, vv, valid, d ** -0.5)
        assert (n > 0) == bool(torch.isfinite(lse).all())
        os.append(o)
        lses.append(lse)
        at += n
    out, lse = combine(torch.stack(os), torch.stack(lses))
    assert float((out[0] - want).abs().max()) < 1e-12
    s = torch.einsum("hd,lhd->hl", q[0], k.repeat_interleave(2, 1)) * d ** -0.5
    assert float((lse[0] - torch.logsumexp(s, -1)).abs().max()) < 1e-12


def test_sampling_follows_the_distribution_and_its_limits():
    """Greedy takes the argmax; with top-k 1 or a tiny top-p sampling is greedy; over many uniforms the sampled
    frequencies follow softmax(z / T) (4 sigma of a binomial); top-k never picks outside the k largest."""
    torch.manual_seed(0)
    logits = torch.randn(1, 10, dtype=torch.float64)
    best = int(logits.argmax())
    assert int(choose(logits, torch.tensor([0.3]), Sampling())) == best
    u = uniforms(3, 4000, 1)[:, 0]
    rows = logits.expand(4000, -1)
    for how in (Sampling(temperature=1.0, top_k=1), Sampling(temperature=1.0, top_p=1e-6)):
        assert (choose(rows, u, how) == best).all()
    picked = choose(rows, u, Sampling(temperature=0.7))
    p = torch.softmax(logits[0] / 0.7, -1)
    freq = torch.bincount(picked, minlength=10).double() / 4000
    assert float(((freq - p).abs() / (p * (1 - p) / 4000).sqrt()).max()) < 4
    top3 = set(logits[0].topk(3).indices.tolist())
    assert set(choose(rows, u, Sampling(temperature=2.0, top_k=3)).tolist()) <= top3
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0.0)
    assert math.isclose(float(u.mean()), 0.5, abs_tol=0.03)

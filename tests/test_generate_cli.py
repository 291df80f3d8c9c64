"""``flashpar generate``: a transformers-saved folder with its tokenizer, prompts as text and as tokens, on a
tp 2 x cp 2 mesh of spawned ranks; the output file against transformers' greedy ``generate``; bad input as one
line before any rank starts."""

from __future__ import annotations

import json

import pytest
import torch

from flashpar.cli import main

EOD = "<|endoftext|>"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A random ``LlamaForCausalLM`` (vocabulary 320) and a byte-level BPE ``tokenizer.json`` beside it."""
    transformers = pytest.importorskip("transformers")
    tk = pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("gen")
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   initializer_range=0.1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(root / "llama")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.train_from_iterator(["hello world, the quick brown fox"] * 20, tk.trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOD], show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "llama" / "tokenizer.json"))
    return root, model, tok


def _run(args, capfd) -> tuple[int, str, str]:
    code = main(["generate", "--no-progress", *map(str, args)])
    out = capfd.readouterr()
    return code, out.out, out.err


def test_generate_writes_transformers_greedy_tokens_in_input_order(folder, capfd):
    """Two text prompts and one of token ids on tp 2 x cp 2 (the 30-token prompt split over the cp ranks at the
    default plan, or not: either decode path must give the same tokens): each output line is the prompt's id,
    its length, transformers' greedy tokens (up to and including the end-of-text token, the tokenizer's
    ``<|endoftext|>``) and their text; the timing lines are printed."""
    root, model, tok = folder
    prompts = root / "p.jsonl"
    ids = list(range(1, 31))
    prompts.write_text("\n".join([json.dumps({"text": "hello world"}), json.dumps({"tokens": ids}), "",
                                  json.dumps({"text": "the quick brown fox jumps"})]) + "\n")
    out = root / "out.jsonl"
    code, stdout, err = _run(["--init-from", root / "llama", "--prompts", prompts, "--tp", 2, "--cp", 2,
                              "--max-new-tokens", 8, "--out", out], capfd)
    assert code == 0, err
    assert "time to first token" in stdout and "decode" in stdout and "K/V cache per rank" in stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    eod = tok.token_to_id(EOD)
    inputs = [tok.encode("hello world").ids, ids, tok.encode("the quick brown fox jumps").ids]
    assert [r["id"] for r in rows] == [0, 1, 2] and [r["prompt_tokens"] for r in rows] == [len(p) for p in inputs]
    for row, p in zip(rows, inputs, strict=True):
        with torch.no_grad():
            want = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):]
        want = want.tolist()
        if eod in want:
            want = want[: want.index(eod) + 1]
        assert row["tokens"] == want, (row, want)
        assert row["text"] == tok.decode(want)


@pytest.mark.parametrize("content, args, says", [
    ('{"text": "hello"}\n{"tokens": [1, 2,\n', [], "line 2: not JSON"),
    ('{"tokens": []}\n', [], "line 1: the prompt is empty"),
    ('{"tokens": [1, 2, 320]}\n', [], "token id 320 outside the vocabulary"),
    ('{"tokens": [1, "a"]}\n', [], "line 1: 'tokens' must be a list of integer token ids"),
    ('{"prompt": "x"}\n', [], "line 1: expected an object with one of 'text' or 'tokens'"),
    ('{"tokens": [1, 2]}\n', ["--max-new-tokens", 63], "exceeds the model's 64 positions"),
    ('{"tokens": [1, 2]}\n', ["--tp", 3], "--tp 3: the model's heads = 4 is not divisible"),
    ('{"tokens": [1, 2]}\n', ["--ulysses", 2], "--ulysses 2"),
    ('{"tokens": [1, 2]}\n', ["--top-p", 0], "--top-p must be in (0, 1]"),
])
def test_bad_input_is_one_line_before_any_rank_starts(folder, capfd, content, args, says):
    root, _, _ = folder
    prompts = root / "bad.jsonl"
    prompts.write_text(content)
    code, _, err = _run(["--init-from", root / "llama", "--prompts", prompts, *args], capfd)
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_generate_from_a_training_checkpoint_equals_the_float64_models_greedy_tokens(tmp_path, capfd):
    """``--checkpoint`` (a flashpar checkpoint of the seeded model, no tokenizer: token prompts, no text) on tp 2:
    the greedy tokens of the single-process float64 model run on the whole sequence at every step."""
    from dist_harness import run_ranks
    from flashpar.models import Llama, LlamaConfig
    from infer_workers import save_checkpoint

    cfg = LlamaConfig(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, max_positions=64)
    run_ranks(1, save_checkpoint, str(tmp_path / "ckpt" / "step_1"), cfg)
    prompts = tmp_path / "p.jsonl"
    ids = [[5, 9, 2, 33, 7], [1, 2, 3]]
    prompts.write_text("\n".join(json.dumps({"tokens": p}) for p in ids) + "\n")
    out = tmp_path / "out.jsonl"
    code, _, err = _run(["--checkpoint", tmp_path / "ckpt", "--prompts", prompts, "--tp", 2, "--max-new-tokens", 5,
                         "--out", out], capfd)
    assert code == 0, err
    torch.manual_seed(0)  # build's weights (TrainConfig.seed 0)
    ref = Llama(cfg).double()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row, p in zip(rows, ids, strict=True):
        seq = list(p)
        with torch.no_grad():
            for _ in range(5):
                seq.append(int(ref(torch.tensor(seq), [len(seq)])[-1].argmax()))
        assert row["tokens"] == seq[len(p):] and "text" not in row, (row, seq)


def test_read_prompts_of_a_txt_file(tmp_path):
    """A ``.txt`` file: one prompt a line, blank lines skipped, each encoded; without a tokenizer one line naming
    the file's line; another suffix refused."""
    from flashpar.infer.prompts import read_prompts

    path = tmp_path / "p.txt"
    path.write_text("ab\n\n  \ncde\n")
    got = read_prompts(path, lambda text: [ord(c) for c in text])
    assert [(p.tokens, p.text) for p in got] == [([97, 98], "ab"), ([99, 100, 101], "cde")]
    with pytest.raises(ValueError, match="line 1: a text prompt needs a tokenizer"):
        read_prompts(path, None)
    other = tmp_path / "p.csv"
    other.write_text("x\n")
    with pytest.raises(ValueError, match="expected a .jsonl or .txt file"):
        read_prompts(other, None)

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
    ('{"tokens": [1, 2]}\n', ["--n", 0], "--n must be an integer >= 1, got 0"),
    ('{"tokens": [1, 2]}\n', ["--min-p", 1.5], "--min-p must be in [0, 1], got 1.5"),
    ('{"tokens": [1, 2]}\n', ["--repetition-penalty", 0], "--repetition-penalty must be a number > 0"),
    ('{"tokens": [1, 2]}\n', ["--presence-penalty", 3], "--presence-penalty must be in [-2, 2]"),
    ('{"tokens": [1, 2]}\n', ["--frequency-penalty", -2.5], "--frequency-penalty must be in [-2, 2]"),
    ('{"tokens": [1, 2]}\n', ["--stop", ""], "--stop '': a stop string must not be empty"),
    ('{"tokens": [1, 2]}\n', ["--stop-id", 320], "--stop-id 320: not a token id"),
    ('{"tokens": [1, 2]}\n', ["--n", 2, "--temperature", 0], "--n 2 at --temperature 0 (greedy)"),
    ('{"tokens": [1, 2]}\n', ["--chat"], "--chat: "),
    ('{"messages": [{"role": "user", "content": "hi"}]}\n', [], "a 'messages' prompt is a conversation: give --chat"),
    ('{"tokens": [1, 2]}\n', ["--mode", "fast"], "--mode 'fast': expected one of"),
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


def _expected(tok, tokens: list[int], eod: int, stop: str) -> tuple[list[int], str, str]:
    """An output's (tokens, finish reason, text) written out plainly: cut after the end-of-text token, then at
    the first prefix whose text holds ``stop``, the text cut before it."""
    reason = "length"
    if eod in tokens:
        tokens, reason = tokens[: tokens.index(eod) + 1], "eos"
    for k in range(1, len(tokens) + 1):
        text = tok.decode(tokens[:k])
        if stop in text:
            return tokens[:k], "stop", text[: text.index(stop)]
    return tokens, reason, tok.decode(tokens)


@pytest.fixture(scope="module")
def chat(folder):
    """The model folder with a ``tokenizer_config.json`` holding a short chat template (the model has 64
    positions) and ``<|endoftext|>`` as its eos_token."""
    import shutil

    root, _, _ = folder
    out = root / "chat"
    shutil.copytree(root / "llama", out)
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOD, "chat_template": SHORT_TEMPLATE}))
    return out


SHORT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}({{ m['content'] }}){% else %}"
                  "{{ m['role'][0] }}:{{ m['content'] }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}a:"
                  "{% endif %}")
CONVERSATIONS = [[{"role": "user", "content": "hello world"}],
                 [{"role": "system", "content": "fox"}, {"role": "user", "content": "the quick"},
                  {"role": "assistant", "content": "brown"}, {"role": "user", "content": "hello"}]]


def test_chat_from_stdin_with_a_penalty_stop_string_and_logprobs_equals_transformers(folder, chat, capfd,
                                                                                     monkeypatch):
    """Conversations on stdin (``--prompts -``, ``--chat``) on tp 2, greedy with ``--repetition-penalty 1.3``, a
    ``--stop`` string and ``--logprobs``: each output's tokens, text and finish reason equal transformers'
    ``apply_chat_template`` + ``generate`` (same penalty) cut as written out in ``_expected``; the log-probabilities
    equal ``log_softmax`` of transformers' processed scores (``output_scores``: after the penalty) within 1e-4
    (two fp32 implementations of the model: their logits differ by about 1e-6)."""
    import io

    import transformers

    _, model, tok = folder
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(str(chat))
    eod = tok.token_to_id(EOD)
    runs = []
    for messages in CONVERSATIONS:
        ids = list(theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=20, do_sample=False, repetition_penalty=1.3, eos_token_id=None,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        new = gen.sequences[0, len(ids):].tolist()
        lps = [float(torch.log_softmax(s[0].double(), -1)[t]) for s, t in zip(gen.scores, new, strict=True)]
        runs.append((ids, new, lps))
    stop = tok.decode(runs[0][1][3:5])  # a piece of the first output's text: it ends there, or earlier
    assert stop
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(json.dumps({"messages": m}) for m in CONVERSATIONS)))
    out = chat.parent / "chat-out.jsonl"
    code, stdout, err = _run(["--init-from", chat, "--chat", "--prompts", "-", "--tp", 2, "--max-new-tokens", 20,
                              "--repetition-penalty", 1.3, "--stop", stop, "--logprobs", "--out", out], capfd)
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ended = []
    for row, (ids, new, lps) in zip(rows, runs, strict=True):
        tokens, reason, text = _expected(tok, new, eod, stop)
        assert row["prompt_tokens"] == len(ids) and "index" not in row
        assert (row["tokens"], row["finish_reason"], row["text"]) == (tokens, reason, text), (row, tokens, reason)
        assert len(row["logprobs"]) == len(tokens)
        assert max(abs(a - b) for a, b in zip(row["logprobs"], lps, strict=False)) < 1e-4
        ended.append(reason != "length" and len(tokens) <= 17)
    assert rows[0]["finish_reason"] == "stop"
    # every 16 steps the ranks check whether every output has ended (the stop strings read on the host then):
    # outputs all ended within the first 17 tokens stop the decode loop after 16 steps, else it runs all 19
    assert f"x {16 if all(ended) else 19} steps" in stdout, (ended, stdout)


def test_sampling_flags_without_a_temperature_sample_at_1_and_say_so(folder, capfd):
    """``--top-p 0.9 --n 2`` without ``--temperature`` on cp 2: one line says it samples at temperature 1; two
    outputs per prompt (``id``, ``index``), each with its finish reason; the samples are not the greedy tokens."""
    root, _, _ = folder
    prompts = root / "n.jsonl"
    prompts.write_text(json.dumps({"text": "hello world"}) + "\n" + json.dumps({"tokens": [5, 6, 7]}) + "\n")
    out = root / "n-out.jsonl"
    code, _, err = _run(["--init-from", root / "llama", "--prompts", prompts, "--cp", 2, "--max-new-tokens", 6,
                         "--top-p", 0.9, "--n", 2, "--seed", 1, "--out", out], capfd)
    assert code == 0, err
    assert "sampling at --temperature 1 (--top-p, --seed, --n given without --temperature" in err, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["index"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["finish_reason"] in ("eos", "length") and r["tokens"] for r in rows)
    assert rows[0]["tokens"] != rows[1]["tokens"] or rows[2]["tokens"] != rows[3]["tokens"]


@pytest.mark.parametrize("line, says", [
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "line 1: message 0 has role 'robot'"),
    ('{"text": "hi"}', "line 1: with --chat every line is an object with 'messages'"),
    ('{"messages": []}', "line 1: 'messages' must be a non-empty list"),
])
def test_bad_conversations_are_one_line_before_any_rank_starts(chat, capfd, line, says):
    prompts = chat.parent / "bad-chat.jsonl"
    prompts.write_text(line + "\n")
    code, _, err = _run(["--init-from", chat, "--chat", "--prompts", prompts], capfd)
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_a_checkpoint_reads_text_with_the_tokenizer_its_run_recorded(folder, tmp_path, capfd):
    """A run trained with ``--tokenizer`` records it (meta.json ``sources``): ``--checkpoint`` with text prompts
    and no ``--tokenizer`` tokenizes with it, stops at the run's end of document and writes text (the greedy
    tokens of the float64 model).  Another ``--tokenizer`` says in one line it is not the run's; a recorded
    tokenizer that is gone is one line (exit 2) for text prompts."""
    import shutil

    from dist_harness import run_ranks
    from flashpar.generate_command import GenerateConfig, check
    from flashpar.models import Llama, LlamaConfig
    from infer_workers import save_checkpoint

    root, _, tok = folder
    tokdir = tmp_path / "tok"
    tokdir.mkdir()
    shutil.copy(root / "llama" / "tokenizer.json", tokdir / "tokenizer.json")
    cfg = LlamaConfig(vocab_size=320, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, max_positions=64)
    run_ranks(1, save_checkpoint, str(tmp_path / "ckpt" / "step_1"), cfg, str(tokdir))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"text": "the quick brown"}) + "\n")
    out = tmp_path / "out.jsonl"
    code, _, err = _run(["--checkpoint", tmp_path / "ckpt", "--prompts", prompts, "--max-new-tokens", 5,
                         "--out", out], capfd)
    assert code == 0, err
    torch.manual_seed(0)  # build's weights (TrainConfig.seed 0)
    ref = Llama(cfg).double()
    seq = tok.encode("the quick brown").ids
    start, eod = len(seq), tok.token_to_id(EOD)
    with torch.no_grad():
        while len(seq) < start + 5 and (len(seq) == start or seq[-1] != eod):
            seq.append(int(ref(torch.tensor(seq), [len(seq)])[-1].argmax()))
    row = json.loads(out.read_text())
    assert (row["tokens"], row["text"]) == (seq[start:], tok.decode(seq[start:])), (row, seq[start:])
    other = tmp_path / "other"
    other.mkdir()
    changed = type(tok).from_file(str(tokdir / "tokenizer.json"))
    changed.add_tokens(["<|other|>"])
    changed.save(str(other / "tokenizer.json"))
    job = check(GenerateConfig(prompts=str(prompts), checkpoint=str(tmp_path / "ckpt"), tokenizer=str(other)))
    assert len(job.notes) == 1 and "not the model's own tokenizer.json" in job.notes[0], job.notes
    shutil.rmtree(tokdir)
    code, _, err = _run(["--checkpoint", tmp_path / "ckpt", "--prompts", prompts], capfd)
    assert code == 2 and "no longer exists: give --tokenizer" in err and len(err.strip().splitlines()) == 1, err

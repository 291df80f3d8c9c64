"""Generation's options in one process: the penalties and the top-k / top-p / min-p limits against transformers'
logits processors on the same float64 logits, the log-probabilities, the implied temperature, where outputs end
(finish reasons, stop strings), chat templates against transformers' ``apply_chat_template``, prompts from stdin
and bad conversations, and ``flashpar generate --help`` (every option's default, no torch import)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashpar.infer.penalties import History, frequency_presence, repetition
from flashpar.infer.sampling import Sampling, SamplingError, choose, truncate, uniforms
from flashpar.infer.stopping import Stopping, finish

V = 50


def _logits_and_ids(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(4, V, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, V, (4, 9), generator=gen)
    return logits, ids


@pytest.mark.parametrize("r", [0.7, 1.3])
def test_repetition_penalty_equals_transformers_processor(r):
    """On float64 logits the same arithmetic on the same entries: equal to the bit."""
    processors = pytest.importorskip("transformers.generation.logits_process")
    logits, ids = _logits_and_ids()
    want = processors.RepetitionPenaltyLogitsProcessor(r)(ids, logits.clone())
    seen = torch.zeros(4, V, dtype=torch.bool).scatter_(1, ids, True)
    assert torch.equal(repetition(logits, seen, r), want)


def test_frequency_and_presence_penalties_follow_their_definition():
    """``l_v - f c_v - a [c_v > 0]`` written token by token over the output (the prompt is not counted); exact up
    to the order of two float64 subtractions (1e-12)."""
    logits, ids = _logits_and_ids(1)
    prompt, output = ids[:, :4], ids[:, 4:]
    history = History([p.tolist() for p in prompt], V, torch.device("cpu"), repetition=False, counted=True)
    for t in output.T:
        history.add(t)
    got = history.apply(logits, Sampling(frequency_penalty=0.4, presence_penalty=-0.3))
    want = logits.clone()
    for row in range(4):
        out = output[row].tolist()
        for v in set(out):
            want[row, v] -= 0.4 * out.count(v) + -0.3
    assert float((got - want).abs().max()) < 1e-12
    assert torch.equal(frequency_presence(logits, torch.zeros(4, V, dtype=torch.int32), 0.4, 0.3), logits)


def test_the_history_of_prompt_and_output_is_what_the_repetition_penalty_reads():
    """``History`` built from the prompts and fed the outputs token by token marks the tokens of both, as the
    ``input_ids`` transformers' processor reads; the penalties then equal transformers' on the whole sequence."""
    processors = pytest.importorskip("transformers.generation.logits_process")
    logits, ids = _logits_and_ids(2)
    history = History([p.tolist() for p in ids[:, :5]], V, torch.device("cpu"), repetition=True, counted=False)
    for t in ids[:, 5:].T:
        history.add(t)
    want = processors.RepetitionPenaltyLogitsProcessor(1.5)(ids, logits.clone())
    assert torch.equal(history.apply(logits, Sampling(repetition_penalty=1.5)), want)


@pytest.mark.parametrize("settings", [{"top_k": 10}, {"top_p": 0.7}, {"min_p": 0.2},
                                      {"top_k": 12, "top_p": 0.8, "min_p": 0.1}, {"top_k": 3, "min_p": 0.5}])
def test_top_k_top_p_min_p_equal_transformers_warpers_in_their_order(settings):
    """The tokens kept and their logits after top-k, top-p and min-p equal transformers' TopK, TopP and MinP
    warpers applied in that order (its order) to the same float64 logits: equal sets (the sums compared with
    top_p differ only in summation order, 1e-16 relative, far from these logits' gaps) and equal values."""
    processors = pytest.importorskip("transformers.generation.logits_process")
    logits, ids = _logits_and_ids(3)
    how = Sampling(temperature=1.0, **settings)
    want = logits.clone()
    if how.top_k:
        want = processors.TopKLogitsWarper(how.top_k)(ids, want)
    if how.top_p < 1:
        want = processors.TopPLogitsWarper(how.top_p)(ids, want)
    if how.min_p:
        want = processors.MinPLogitsWarper(how.min_p)(ids, want)
    got = truncate(logits, how)
    kept = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), kept) and torch.equal(got[kept], want[kept])
    assert 0 < int(kept.sum()) < logits.numel()  # the limits did remove tokens, and kept some


def test_sampling_draws_only_kept_tokens_and_logprobs_are_after_penalties_and_temperature():
    """Sampled tokens lie among those min-p and top-k keep; each chosen token's log-probability is
    ``log_softmax((penalized logits) / T)`` at it (greedy: T = 1), exactly (the same float64 ops)."""
    logits, ids = _logits_and_ids(4)
    rows = logits.repeat(50, 1)
    u = uniforms(5, 1, rows.shape[0])[0]
    how = Sampling(temperature=0.8, top_k=8, min_p=0.05, repetition_penalty=1.2)
    history = History([p.tolist() for p in ids.repeat(50, 1)], V, torch.device("cpu"), repetition=True,
                      counted=False)
    lp = torch.empty(rows.shape[0], dtype=torch.float64)
    tokens = choose(rows, u, how, history, lp)
    z = history.apply(rows, how) / 0.8
    assert bool(torch.isfinite(truncate(z, how)).gather(1, tokens[:, None]).all())
    assert torch.equal(lp, torch.log_softmax(z, -1).gather(1, tokens[:, None])[:, 0])
    greedy = Sampling(repetition_penalty=1.2)
    lp1 = torch.empty(rows.shape[0], dtype=torch.float64)
    tokens = choose(rows, u, greedy, history, lp1)
    z = history.apply(rows, greedy)
    assert torch.equal(tokens, z.argmax(-1)) and torch.equal(lp1, torch.log_softmax(z, -1).max(-1).values)


def test_sampling_settings_without_a_temperature_sample_at_temperature_1():
    """A setting only sampling reads, given without a temperature, samples at 1 and says so; none of them: greedy;
    an explicit 0 with them stays greedy and says they do nothing; ``n > 1`` at an explicit 0 is refused."""
    for given in ({"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}, {"seed": 3}, {"n": 2}):
        how = Sampling(**given)
        assert how.temperature == 1.0 and not how.greedy and "sampling at temperature 1" in how.note(), given
    assert Sampling().greedy and Sampling().note() is None
    assert Sampling(repetition_penalty=1.2).greedy  # penalties apply to greedy choice too
    assert "has no effect" in Sampling(temperature=0, top_k=5).note()
    with pytest.raises(SamplingError, match="n 2 at temperature 0"):
        Sampling(temperature=0, n=2)
    assert Sampling(temperature=0.5, top_p=0.9).note() is None


@pytest.mark.parametrize("settings, says", [
    ({"min_p": 1.5}, "min_p must be in [0, 1]"), ({"min_p": -0.1}, "min_p must be in [0, 1]"),
    ({"n": 0}, "n must be an integer >= 1"), ({"repetition_penalty": 0}, "repetition_penalty must be a number > 0"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
])
def test_bad_sampling_settings_are_one_line(settings, says):
    with pytest.raises(SamplingError, match=says.replace("[", r"\[").replace("]", r"\]")):
        Sampling(**settings)


def _chars(ids):
    return "".join(chr(96 + t) for t in ids)


def test_finish_reasons_and_where_outputs_end():
    """eos and stop tokens end an output and stay its last token; a stop string ends it at the token that
    completes it, the text cut before it; the earliest of them wins; else "length"."""
    s = Stopping(eos_id=5, stop_ids=(9,), stop=("cd",))
    assert finish([1, 2, 5, 7], s, _chars) == ([1, 2, 5], "eos", "abe")
    assert finish([1, 9, 5], s, _chars) == ([1, 9], "stop", "ai")
    assert finish([1, 2, 3, 4, 5], s, _chars) == ([1, 2, 3, 4], "stop", "ab")  # "cd" ends at token 4
    assert finish([1, 2, 3, 4, 5], Stopping(stop=("bcd", "c")), _chars) == ([1, 2, 3], "stop", "ab")
    assert finish([1, 2, 3], s, _chars) == ([1, 2, 3], "length", "abc")
    assert finish([1, 2, 3], Stopping(), None) == ([1, 2, 3], "length", None)


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """A byte-level BPE ``tokenizer.json`` with a ChatML-like template (bos, a system default, an error on an
    unknown role, the generation prompt) in ``tokenizer_config.json``."""
    tk = pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("chat")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.train_from_iterator(["hello world, the quick brown fox"] * 20, tk.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"], show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "<|im_end|>",
                                                            "chat_template": CHAT_TEMPLATE}))
    return root


CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|im_start|>system\nbe brief<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('no role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CONVERSATIONS = [[{"role": "user", "content": "hello world"}],
                 [{"role": "system", "content": "the fox"}, {"role": "user", "content": " quick brown "},
                  {"role": "assistant", "content": "hello"}, {"role": "user", "content": "world"}]]


def test_chat_template_tokens_equal_transformers_apply_chat_template(chat_folder):
    """The conversation's ids equal transformers' ``apply_chat_template(..., add_generation_prompt=True)`` of the
    same folder; the end-of-text token is the config's ``eos_token``; a template's own error is one line."""
    transformers = pytest.importorskip("transformers")
    from flashpar.infer.tokenizer import load

    ours = load(chat_folder, vocab_size=300)
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(str(chat_folder))
    for messages in CONVERSATIONS:
        want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ours.chat(messages) == list(want), (messages, ours.chat(messages), want)
    assert ours.eos == theirs.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(ValueError, match="the chat template refused the conversation: no role tool"):
        ours.chat([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("line, says", [
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "message 0 has role 'robot'; expected one of"),
    ('{"messages": []}', "'messages' must be a non-empty list"),
    ('{"text": "hi"}', "with --chat every line is an object with 'messages'"),
    ('{"messages": [{"role": "user"}]}', "message 0 must be an object with a string 'role' and a string 'content'"),
])
def test_bad_conversations_are_one_line_naming_the_line(chat_folder, tmp_path, line, says):
    from flashpar.infer.prompts import read_prompts
    from flashpar.infer.tokenizer import load

    path = tmp_path / "p.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n' + line + "\n")
    tok = load(chat_folder)
    with pytest.raises(ValueError, match="line 2: " + says.replace("[", r"\[")):
        read_prompts(path, tok.encode, tok.chat)


def test_prompts_from_stdin_and_messages_without_chat(monkeypatch, tmp_path):
    """``-`` reads standard input as .jsonl; a conversation without ``--chat`` and plain text on stdin are one
    line each, saying what to do."""
    from flashpar.infer.prompts import read_prompts

    monkeypatch.setattr(sys, "stdin", io.StringIO('{"tokens": [1, 2]}\n\n{"text": "ab"}\n'))
    got = read_prompts("-", lambda text: [ord(c) for c in text])
    assert [(p.tokens, p.text) for p in got] == [([1, 2], None), ([97, 98], "ab")]
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    with pytest.raises(ValueError, match=r"line 1: not JSON .*stdin is read as .jsonl"):
        read_prompts("-", None)
    path = tmp_path / "p.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ValueError, match="a 'messages' prompt is a conversation: give --chat"):
        read_prompts(path, None)


def test_generate_help_says_every_default_and_imports_no_torch():
    """Building ``flashpar generate``'s parser imports no torch (``--help`` stays fast), and every option's help
    says its default (or is a required choice)."""
    src = str(Path(__file__).resolve().parent.parent / "src")
    code = ("import argparse, sys\nfrom flashpar import generate_command as g\np = argparse.ArgumentParser()\n"
            "g.add_arguments(p)\nassert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
            "for a in p._actions:\n    print(a.option_strings[0], '|', a.help)\n")
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": src}, capture_output=True, text=True,
                         check=True).stdout
    lines = [line.split(" | ", 1) for line in out.splitlines()]
    missing = [name for name, text in lines if name not in ("-h", "--init-from", "--checkpoint", "--prompts")
               and "(default:" not in text]
    assert not missing, missing
    assert len(lines) > 25


def test_compile_flag_reaches_the_model():
    """``--compile``: the config's ``compile`` (off unless given), which ``rank_main`` builds the model with
    (``ParallelLlama(..., compile=config.compile)``) and warms before the prompts (``warm_up(model, grad=False)``);
    a compiled prefill's logits against eager ones: ``tests/test_prefill_bench.py``."""
    import argparse
    import inspect

    from flashpar import generate_command as g

    p = argparse.ArgumentParser()
    g.add_arguments(p)
    base = ["--init-from", "x", "--prompts", "p.jsonl"]
    assert g.from_args(p.parse_args([*base, "--compile"])).compile is True
    assert g.from_args(p.parse_args(base)).compile is False
    src = inspect.getsource(g.rank_main)
    assert "compile=config.compile" in src and "warm_up(model, grad=False)" in src

"""A run from a Hugging Face folder tokenizes with the folder's tokenizer: taken when --tokenizer is left out, a
different --tokenizer refused, a folder without one said in a warning."""

from __future__ import annotations

import json

import pytest

from flashpar.train.tokenizer_choice import choose

tk = pytest.importorskip("tokenizers")


def _tokenizer(path, texts, vocab):
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, tk.trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                          show_progress=False,
                                                          initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``own``: a Llama folder (config, weights, tokenizer.json); ``bare``: the same without tokenizer.json;
    ``other.json``: another tokenizer; ``copy/tokenizer.json``: the folder's, byte for byte."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("choice")
    texts = ["def f(x):\n    return x + 1\n" * 20, "class A:\n    pass\n" * 30, "import os\nprint(os.sep)\n" * 10]
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    for name in ("own", "bare"):
        transformers.LlamaForCausalLM(cfg).save_pretrained(root / name)
    _tokenizer(root / "own" / "tokenizer.json", texts, 300)
    _tokenizer(root / "other.json", texts[:1], 280)
    (root / "copy").mkdir()
    (root / "copy" / "tokenizer.json").write_bytes((root / "own" / "tokenizer.json").read_bytes())
    return root


def test_each_row_of_the_table(folders):
    own, bare = str(folders / "own"), str(folders / "bare")
    assert choose(None, None) == (None, None)
    assert choose("t.json", None) == ("t.json", None)
    path, line = choose(None, own)
    assert path == str(folders / "own" / "tokenizer.json") and line == (
        f"--init-from {own}: the data are tokenized with its tokenizer.json")
    assert choose(str(folders / "copy"), own) == (str(folders / "copy"), None)  # the same bytes elsewhere
    assert choose(str(folders / "own" / "tokenizer.json"), own)[1] is None
    with pytest.raises(ValueError, match="leave --tokenizer out") as err:
        choose(str(folders / "other.json"), own)
    assert "\n" not in str(err.value) and "other.json" in str(err.value)
    path, line = choose(None, bare)
    assert path is None and line.startswith(f"warning: --init-from {bare} has no tokenizer.json")
    assert choose(str(folders / "other.json"), bare) == (str(folders / "other.json"), None)


def test_ready_takes_the_folders_tokenizer_and_says_so(folders, tmp_path, capsys):
    """Without --tokenizer the run's token cache is the folder tokenizer's (the same as naming it), not bytes."""
    from flashpar.train.config import TrainConfig, ready
    from flashpar.train.tokens import describe

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.jsonl").write_text("".join(json.dumps({"text": "def g(y):\n    return y\n" * 30}) + "\n"
                                          for _ in range(6)))
    own = str(folders / "own")

    def config(**kw):
        from flashpar.models import LlamaConfig

        return TrainConfig(nproc=1, dp=1, cp=1, tp=1, seq_len=128, workers=0, init_from=own, data=(str(docs),),
                           model=LlamaConfig.from_hf(own), out=str(tmp_path / "run"), **kw)

    implicit = ready(config(), 1)
    assert implicit.tokenizer == str(folders / "own" / "tokenizer.json")
    err = capsys.readouterr().err
    assert f"flashpar train: --init-from {own}: the data are tokenized with its tokenizer.json" in err, err
    named = ready(config(tokenizer=own), 1)
    assert describe(implicit) == describe(named)  # one token cache: the same tokenizer
    with pytest.raises(ValueError, match="is not --init-from"):
        ready(config(tokenizer=str(folders / "other.json")), 1)


def test_the_advice_names_what_the_command_can_do(folders, tmp_path):
    """A model from --init-from has the folder's sizes: the advice is its own tokenizer, never --vocab-size."""
    from flashpar.train import tokens

    with pytest.raises(ValueError, match="vocab_size 200; give --tokenizer: the tokenizer.json the model was"):
        tokens.bytes_fit(200, init_from="folder")
    with pytest.raises(ValueError, match="vocab_size 200; give a --tokenizer that fits, or --vocab-size 256"):
        tokens.bytes_fit(200)

    class Run:
        def __init__(self, init_from):
            self.init_from = init_from

    line = tokens.vocabulary_fix(Run("F"))
    assert "--vocab-size" not in line and "leave --tokenizer out" in line
    assert tokens.vocabulary_fix(Run(None)).format(need=300) == "use --vocab-size 300 or more"
    with pytest.raises(ValueError, match="fit the model's vocab_size 256; the model of --init-from F is fixed"):
        tokens.load_tokenizer(folders / "own", vocab_size=256, fix=tokens.vocabulary_fix(Run("F")))

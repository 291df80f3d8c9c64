"""The tokenizer of ``flashpar generate``: a Hugging Face ``tokenizer.json`` (read by the ``tokenizers`` library)
and, beside it, what transformers keeps with it:

    tokenizer_config.json   eos_token (the end-of-text token), the other special tokens, chat_template
    chat_template.jinja     the chat template (where present, it is the one used, as transformers does)

End of text: ``tokenizer_config.json``'s ``eos_token`` where the vocabulary has it, else the first of
``EOD_NAMES`` it has (``flashpar.tokenizer_files``: the trainer's end-of-document names too), else none.

Chat (``--chat``): the conversation ``[{"role", "content"}, ...]`` rendered by the template with jinja2 in a
sandbox (trim_blocks, lstrip_blocks, as transformers renders it), with ``messages``, ``add_generation_prompt``
True (the prompt ends where the assistant's reply begins, as vLLM's chat does) and the special tokens
(``bos_token``, ``eos_token``, ...) as variables; the text is encoded without adding special tokens (the
template writes them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from flashpar.tokenizer_files import EOD_NAMES, token_text, tokenizer_json

SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class TextTokenizer:
    """A loaded tokenizer: ``encode``, ``decode``, ``eos`` (None: none found), ``chat_template`` (None: none)."""

    path: Path
    eos: int | None
    chat_template: str | None
    special: dict[str, str]
    tok: object = field(repr=False)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def check_chat(self) -> TextTokenizer:
        """Itself, or ``ValueError`` (one line) where it has no chat template."""
        if self.chat_template is None:
            raise ValueError(f"--chat: {self.path.parent} has no chat template (a 'chat_template' in "
                             "tokenizer_config.json, or chat_template.jinja)")
        return self

    def chat(self, messages: list[dict]) -> list[int]:
        """The token ids of the conversation ``messages`` (checked by ``check_messages``) rendered by the chat
        template; ``ValueError`` without a template or where the template raises."""
        return self.check_chat().tok.encode(render_chat(self.chat_template, messages, self.special),
                               add_special_tokens=False).ids


def load(path, vocab_size: int | None = None) -> TextTokenizer:
    """The tokenizer at ``path`` (a ``tokenizer.json`` or its folder), checked against the model's
    ``vocab_size``; ``ValueError``: one line."""
    from tokenizers import Tokenizer

    file = tokenizer_json(path)
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 - the library raises its own exception types
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"--tokenizer {path}: not a Hugging Face tokenizer.json ({first})") from None
    tok.no_truncation()
    tok.no_padding()
    vocab = tok.get_vocab(with_added_tokens=True)
    largest = max(vocab.values(), default=-1)
    if vocab_size is not None and largest >= vocab_size:
        raise ValueError(f"--tokenizer {path}: its largest token id {largest} is outside the model's vocabulary "
                         f"[0, {vocab_size}): it is not this model's tokenizer")
    config = _config(file.with_name("tokenizer_config.json"))
    special = {}
    for name in SPECIAL:
        if (value := token_text(config.get(name))) is not None:
            special[name] = value
    names = [n for n in (special.get("eos_token"), *EOD_NAMES) if n]
    eos = next((vocab[n] for n in names if n in vocab), None)
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    jinja = file.with_name("chat_template.jinja")
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    return TextTokenizer(file, eos, template if isinstance(template, str) else None, special, tok)


def _config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not readable JSON ({err})") from None
    return value if isinstance(value, dict) else {}


def check_messages(messages, where: str) -> list[dict]:
    """``messages`` as a conversation, or ``ValueError`` naming ``where`` and the first problem."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} must be an object with a string 'role' and a string 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: message {i} has role {m['role']!r}; expected one of {', '.join(ROLES)}")
    return messages


def render_chat(template: str, messages: list[dict], special: dict[str, str]) -> str:
    """The text of ``messages`` rendered by the jinja2 ``template`` (the module docstring)."""
    try:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ValueError("--chat renders the chat template with jinja2: pip install jinja2") from None

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True, **special)
    except TemplateError as err:
        raise ValueError(f"--chat: the chat template refused the conversation: {err}") from None

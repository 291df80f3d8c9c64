"""Hugging Face folders in and out (Llama, Mistral, Qwen2, Qwen3: ``flashpar.models.families``):
``load_hf(path) -> Llama``, ``save_hf(model, path)``, and the per-rank slice reader ``WeightFiles`` of
``ParallelLlama.load_hf_slices``.

A folder holds ``config.json`` (``LlamaConfig.from_hf``) and the weights as ``model.safetensors`` or
shards listed by ``model.safetensors.index.json`` (``weight_map``: tensor name -> file), read with the
``safetensors`` library (no ``transformers`` needed).  The names map one to one (``HF_NAMES``)::

    flashpar (Llama)              Hugging Face (LlamaForCausalLM, MistralForCausalLM, Qwen2/3ForCausalLM)
    embed.weight                  model.embed_tokens.weight
    blocks.N.attn_norm.weight     model.layers.N.input_layernorm.weight
    blocks.N.{q,k,v,o}_proj       model.layers.N.self_attn.{q,k,v,o}_proj     (.weight, .bias where the family has it)
    blocks.N.{q,k}_norm.weight    model.layers.N.self_attn.{q,k}_norm.weight  (Qwen3)
    blocks.N.mlp_norm.weight      model.layers.N.post_attention_layernorm.weight
    blocks.N.{gate,up,down}       model.layers.N.mlp.{gate,up,down}_proj      (.weight, .bias with mlp_bias)
    norm.weight                   model.norm.weight
    head.weight                   lm_head.weight                      (untied only)

and the tensors are the same (both store ``[out, in]`` linear weights and rotate the half-split
form).  Reading validates the files against the config before any tensor is read: every expected
tensor present, with its shape, nothing unexpected (a tied model's ``lm_head.weight``, which some
writers keep, and old ``rotary_emb.inv_freq`` buffers are skipped), one ``ValueError`` line naming
them.  ``WeightFiles.read(name, piece)`` reads only the rows / columns of a ``layout.Piece``
(``safe_open(...).get_slice(name)[rows, cols]``) and counts the bytes it read.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from flashpar.models.config import LlamaConfig
from flashpar.models.families import write_features
from flashpar.models.layout import Piece, padded
from flashpar.models.llama import Llama
from flashpar.models.rope_scaling import hf_rope

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
HF_NAMES = {  # flashpar module name (under blocks.N. for the blocks) -> Hugging Face's
    "embed": "model.embed_tokens", "norm": "model.norm", "head": "lm_head",
    "attn_norm": "input_layernorm", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj", "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm", "mlp_norm": "post_attention_layernorm",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
}
FLOATS = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def hf_name(name: str) -> str:
    """Hugging Face's name of single-process parameter ``name`` (``blocks.3.gate.weight`` ->
    ``model.layers.3.mlp.gate_proj.weight``)."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blocks" and parts[2] in HF_NAMES and parts[2] not in ("embed", "norm", "head"):
        return f"model.layers.{parts[1]}.{HF_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in ("embed", "norm", "head"):
        return f"{HF_NAMES[parts[0]]}.{parts[1]}"
    raise KeyError(f"parameter {name!r} has no Hugging Face name")


def empty_llama(cfg: LlamaConfig) -> Llama:
    """A ``Llama`` on the meta device (no memory), built without its random init: ``normal_`` on meta
    tensors imports torch's compiler stack (seconds in every process); fill it with
    ``load_state_dict(..., assign=True)``."""
    normal = torch.nn.init.normal_
    torch.nn.init.normal_ = lambda tensor, *args, **kwargs: tensor  # Llama's and nn.Embedding's init
    try:
        with torch.device("meta"):
            return Llama(cfg)
    finally:
        torch.nn.init.normal_ = normal


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The single-process model's parameter names and shapes."""
    return {n: tuple(p.shape) for n, p in empty_llama(cfg).named_parameters()}


class WeightFiles:
    """The safetensors files of a Hugging Face folder, validated against ``cfg`` (the folder's config.json must
    describe the same model, ``init_std`` aside), open for reading by flashpar name; a context manager."""

    def __init__(self, path, cfg: LlamaConfig) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        folder_cfg = LlamaConfig.from_hf(self.path)  # FileNotFoundError / ValueError: one line
        if dataclasses.replace(folder_cfg, init_std=cfg.init_std) != cfg:
            differ = [f.name for f in dataclasses.fields(cfg) if f.name != "init_std"
                      and getattr(cfg, f.name) != getattr(folder_cfg, f.name)]
            raise ValueError(f"{self.path}: the folder's config.json is another model ({', '.join(differ)} differ: "
                             + "; ".join(f"{k} {getattr(folder_cfg, k)} != {getattr(cfg, k)}" for k in differ) + ")")
        self.cfg, self.bytes_read = cfg, 0
        files = _weight_files(self.path)
        self._open, self._where = {}, {}  # file -> handle, Hugging Face name -> handle
        try:
            for file, names in files.items():
                handle = safe_open(str(file), framework="pt")
                self._open[file] = handle
                held = set(handle.keys())
                lost = sorted(set(names) - held) if names is not None else []
                if lost:
                    raise ValueError(f"{self.path / INDEX} maps {', '.join(lost[:4])} to {file.name}, which lacks "
                                     "them")
                for name in (held if names is None else names):
                    if name in self._where:
                        raise ValueError(f"{self.path}: tensor {name} is in two files")
                    self._where[name] = handle
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types on a bad file
            raise ValueError(f"{self.path}: cannot read the safetensors file {file.name}: "
                             f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
        self._check(expected_shapes(cfg))

    def _check(self, want: dict[str, tuple[int, ...]]) -> None:
        by_hf = {hf_name(n): n for n in want}
        skipped = {"lm_head.weight"} if self.cfg.tie_embeddings else set()
        have = {n for n in self._where if n not in skipped and not n.endswith("rotary_emb.inv_freq")}
        missing, unexpected = sorted(set(by_hf) - have), sorted(have - set(by_hf))
        shaped, dtypes = [], set()
        for hf in sorted(set(by_hf) & have):
            sl = self._where[hf].get_slice(hf)
            shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
            if shape != want[by_hf[hf]]:
                shaped.append(f"{hf} {list(shape)} (expected {list(want[by_hf[hf]])})")
            if dtype not in FLOATS:
                shaped.append(f"{hf} of dtype {dtype} (expected a float)")
            dtypes.add(dtype)
        problems = ([f"missing {', '.join(_few(missing))}"] if missing else []) + \
                   ([f"unexpected {', '.join(_few(unexpected))}"] if unexpected else []) + \
                   ([f"mis-shaped {', '.join(_few(shaped))}"] if shaped else [])
        if problems:
            raise ValueError(f"{self.path}: the weights do not fit config.json: {'; '.join(problems)}")
        self.dtypes = {FLOATS[d] for d in dtypes}

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of single-process parameter ``name``."""
        hf = hf_name(name)
        return tuple(self._where[hf].get_slice(hf).get_shape())

    def read(self, name: str, piece: Piece | None = None) -> torch.Tensor:
        """Parameter ``name`` (flashpar's name), whole or only the block ``piece``, as stored; counts the bytes.  A
        piece reaching past the stored rows (a padded vocabulary's) gets zero rows there."""
        hf = hf_name(name)
        if piece is None:
            t = self._where[hf].get_tensor(hf)
        else:
            sl = self._where[hf].get_slice(hf)
            t = padded(sl[piece.clipped(sl.get_shape()[0]).index()], piece.rows[1] - piece.rows[0])
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        for handle in self._open.values():
            exit_ = getattr(handle, "__exit__", None)
            if exit_ is not None:
                exit_(None, None, None)
        self._open, self._where = {}, {}

    def __enter__(self) -> WeightFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _few(names: list[str], n: int = 4) -> list[str]:
    return names[:n] + ([f"... ({len(names) - n} more)"] if len(names) > n else [])


def _weight_files(path: Path) -> dict[Path, list[str] | None]:
    """The safetensors files of the folder: ``{file: the names the index puts there}`` (``None``: all of it)."""
    if (path / INDEX).is_file():
        try:
            index = json.loads((path / INDEX).read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                            for k, v in weight_map.items()):
                raise TypeError("weight_map is not an object of names to file names")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{path / INDEX} is not a safetensors index: {err}") from None
        files: dict[Path, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(path / file, []).append(name)
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{path / INDEX} lists files that are not there: {', '.join(_few(absent))}")
        return files
    if (path / WEIGHTS).is_file():
        return {path / WEIGHTS: None}
    raise FileNotFoundError(f"no {WEIGHTS} or {INDEX} in {path}")


def load_hf(path, *, dtype: torch.dtype | None = None) -> Llama:
    """The single-process ``Llama`` of a Hugging Face folder, in ``dtype`` (``None``: the stored dtype, which
    must then be one for all tensors).  ``ValueError`` / ``FileNotFoundError`` with one line for a config
    flashpar does not implement or weights that do not fit it."""
    cfg = LlamaConfig.from_hf(path)
    with WeightFiles(path, cfg) as files:
        if dtype is None:
            if len(files.dtypes) > 1:
                raise ValueError(f"{path}: the tensors have several dtypes "
                                 f"({', '.join(sorted(str(d) for d in files.dtypes))}); pass dtype=")
            dtype = next(iter(files.dtypes))
        state = {n: files.read(n).to(dtype) for n in expected_shapes(cfg)}
    model = empty_llama(cfg)
    model.load_state_dict(state, assign=True, strict=True)
    return model


def hf_config(cfg: LlamaConfig, dtype: torch.dtype = torch.float32) -> dict:
    """A transformers-5 style ``config.json`` of ``cfg`` (``rope_parameters``): its family's ``model_type``,
    ``architectures`` and feature fields (``flashpar.models.families.write_features``)."""
    rope = {**hf_rope(cfg.rope_scaling), "rope_theta": float(cfg.rope_theta)}
    return {**write_features(cfg), "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.layers,
            "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_positions, "rms_norm_eps": cfg.norm_eps,
            "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
            "attention_dropout": 0.0, "rope_parameters": rope,
            "dtype": str(dtype).removeprefix("torch."), "use_cache": True}


def save_hf(model: Llama, path) -> Path:
    """Write ``model`` as a Hugging Face folder: ``config.json`` and ``model.safetensors`` (a tied model
    stores the embedding only, as transformers does).  Returns the folder."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {hf_name(n): p.detach().cpu().contiguous() for n, p in model.named_parameters()}
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1:
        raise ValueError(f"save_hf: the parameters have several dtypes ({', '.join(sorted(map(str, dtypes)))})")
    (path / INDEX).unlink(missing_ok=True)  # a stale index would point transformers at other shards
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config(model.cfg, dtypes.pop()), indent=2) + "\n")
    return path

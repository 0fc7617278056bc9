"""Config values checked against the weights before a model is built: a model folder's ``config.json`` (a
transformers folder or our native MLA folder) or a GGUF file's metadata must hold finite, positive RoPE bases and
norm epsilons, sane sizes, and the layer count, hidden size and vocabulary its weights actually have. A hand-edited
``num_hidden_layers: 1000000`` would otherwise build a million layers before failing, and a NaN ``rope_theta`` would
run and answer garbage. The weights are read from their headers only (safetensors, GGUF): no tensor is loaded.

Each failure is one ``ValueError`` line naming the file and the key (the loaders turn it into a ``LoadError``).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

__all__ = ["check_config_values", "check_gguf_file", "check_model_folder", "check_source", "gguf_header",
           "safetensors_shapes"]

POSITIVE_FLOATS = ("rope_theta", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps",
                   "latent_norm_eps")
"""Keys that must be finite numbers > 0 wherever they appear (top level, ``rope_parameters``, ``text_config``)."""
SIZES = {"num_hidden_layers": "layers", "n_layer": "layers", "n_layers": "layers", "hidden_size": "hidden",
         "n_embd": "hidden", "d_model": "hidden", "vocab_size": None, "num_attention_heads": None,
         "n_head": None, "num_key_value_heads": None, "n_kv_head": None, "intermediate_size": None, "d_ff": None,
         "head_dim": None, "max_position_embeddings": None, "n_positions": None, "max_positions": None}
"""Size keys (integers >= 1) and, for those the weights show, which measure of the weights they must equal (not
the vocabulary: embeddings are often padded beyond it; the loaders check shapes)."""
MAX_SIZE = 1 << 30
MAX_HEADER = 100 << 20
"""A safetensors header larger than this (100 MB of JSON) is not a model's."""
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer|blk)\.(\d+)\.")
_EMBED = ("model.embed_tokens.weight", "embed_tokens.weight", "transformer.wte.weight", "embed.weight",
          "model.language_model.embed_tokens.weight", "gpt_neox.embed_in.weight", "token_embd.weight")


def _configs(cfg: Mapping[str, Any]) -> Iterable[tuple[str, Mapping[str, Any]]]:
    yield "", cfg
    for sub in ("rope_parameters", "rope_scaling", "text_config"):
        if isinstance(cfg.get(sub), Mapping):
            yield f"{sub}.", cfg[sub]


def check_config_values(cfg: Mapping[str, Any], where: str) -> None:
    """RoPE bases and norm epsilons finite and > 0, sizes integers in ``[1, 2^30]`` (``where``: the file)."""
    for prefix, c in _configs(cfg):
        for key in POSITIVE_FLOATS:
            v = c.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{where}: {prefix}{key} must be a finite number > 0, got {v!r}")
        for key in SIZES:
            v = c.get(key)
            if v is None or (key == "head_dim" and v == 0):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SIZE:
                raise ValueError(f"{where}: {prefix}{key} must be an integer in [1, {MAX_SIZE}], got {v!r}")


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 2 <= n <= MAX_HEADER:
            raise ValueError(f"{path}: not a safetensors file (header of {n} bytes)")
        head = json.loads(f.read(n).decode("utf-8"))
    if not isinstance(head, dict):
        raise ValueError(f"{path}: not a safetensors file (header is not a JSON object)")
    return head


def safetensors_shapes(folder: Path) -> Optional[dict[str, tuple[int, ...]]]:
    """Every weight's shape from the folder's safetensors headers (sharded or not); ``None`` without safetensors."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        for name, meta in _header(f).items():
            if name != "__metadata__" and isinstance(meta, dict) and isinstance(meta.get("shape"), list):
                shapes[name] = tuple(int(s) for s in meta["shape"])
    return shapes


def _measures(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
    """What the weights show: ``layers`` (numbered blocks), ``vocab`` and ``hidden`` (the token embedding's rows and
    columns)."""
    got: dict[str, int] = {}
    layers = [int(m.group(1)) for name in shapes for m in [_LAYER.search(name)] if m]
    if layers:
        got["layers"] = max(layers) + 1
    embed = next((shapes[n] for n in _EMBED if n in shapes and len(shapes[n]) == 2), None)
    if embed is not None:
        got["vocab"], got["hidden"] = embed
    return got


def _check_against(cfg: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], where: str) -> None:
    c = cfg
    if isinstance(cfg.get("text_config"), Mapping):  # a multimodal model: its language model's weights only
        c, shapes = cfg["text_config"], {n: s for n, s in shapes.items() if "language_model" in n}
    got = _measures(shapes)
    extra = c.get("num_nextn_predict_layers") or 0  # DeepSeek-V3's multi-token-prediction layers follow the rest
    for key, measure in SIZES.items():
        v = c.get(key)
        if measure is None or measure not in got or not isinstance(v, int):
            continue
        if got[measure] not in (v, v + extra if measure == "layers" and isinstance(extra, int) else v):
            what = {"layers": "numbered layers", "hidden": "columns in the token embedding"}[measure]
            raise ValueError(f"{where}: {key} is {v} but the weights have {got[measure]} {what}")


def check_model_folder(folder: Path) -> None:
    """A model folder's ``config.json`` values, and its sizes against its safetensors weights (when it has them)."""
    folder = Path(folder)
    where = folder / "config.json"
    try:
        cfg = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: not a readable JSON file ({type(e).__name__})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: not a JSON object")
    check_config_values(cfg, str(where))
    shapes = safetensors_shapes(folder)
    if shapes:
        _check_against(cfg, shapes, str(where))


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_header(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """A GGUF file's scalar metadata and every tensor's shape (outermost first), read from its header alone: arrays
    (the tokenizer's) are skipped, not decoded, and every count is bounded by the file's size."""
    import struct

    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        def read(fmt: str) -> Any:
            n = struct.calcsize(fmt)
            b = f.read(n)
            if len(b) != n:
                raise ValueError(f"{path}: a truncated GGUF header")
            return struct.unpack(fmt, b)[0]

        def count(what: str) -> int:
            n = read("<Q")
            if n > size:
                raise ValueError(f"{path}: a GGUF header claims {n} {what}, more than the file has bytes")
            return n

        def string() -> str:
            return f.read(count("string bytes")).decode("utf-8", "replace")

        def value(kind: int) -> Any:
            if kind in _SCALARS:
                return read(_SCALARS[kind])
            if kind == 8:
                return string()
            if kind == 9:
                item, n = read("<I"), count("array items")
                for _ in range(n):
                    value(item)  # skipped: only scalars are checked
                return None
            raise ValueError(f"{path}: unknown GGUF value type {kind}")

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        read("<I")  # version
        n_tensors, n_kv = count("tensors"), count("metadata keys")
        meta = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(read("<I"))
        shapes = {}
        for _ in range(n_tensors):
            name = string()
            dims = [read("<Q") for _ in range(min(read("<I"), 8))]
            read("<I"), read("<Q")  # type, offset
            shapes[name] = tuple(reversed(dims))  # GGUF lists dimensions innermost first
    return meta, shapes


def check_gguf_file(path: Path) -> None:
    """A GGUF file's metadata (``ARCH.block_count``, ``ARCH.embedding_length``, RoPE base, norm epsilons) checked as a
    config, and against its tensors, before transformers builds a model from it."""
    meta, shapes = gguf_header(path)
    arch = meta.get("general.architecture")
    keys = {"num_hidden_layers": "block_count", "hidden_size": "embedding_length", "rope_theta": "rope.freq_base",
            "rms_norm_eps": "attention.layer_norm_rms_epsilon", "layer_norm_eps": "attention.layer_norm_epsilon",
            "max_position_embeddings": "context_length"}
    cfg = {k: meta[f"{arch}.{g}"] for k, g in keys.items() if f"{arch}.{g}" in meta}
    check_config_values(cfg, str(path))
    _check_against(cfg, shapes, str(path))


def check_source(p: Path) -> None:
    """The checks of what :func:`kvsplice.loading.load_model` is about to read (a GGUF file, or a folder holding
    one; a model folder with ``config.json``); a failure is one :class:`kvsplice.loading.LoadError` line."""
    from kvsplice.loading.errors import LoadError
    from kvsplice.loading.gguf import find_gguf

    gguf = find_gguf(p)
    try:
        if gguf is not None:
            check_gguf_file(gguf)
        elif p.is_dir() and (p / "config.json").is_file():
            check_model_folder(p)
    except ValueError as e:
        raise LoadError(" ".join(str(e).split())[:300]) from None
    except Exception as e:  # noqa: BLE001 - a damaged GGUF file: the loader's own message
        raise LoadError(f"cannot load the GGUF model {gguf}: {type(e).__name__}: {' '.join(str(e).split())[:200]}") \
            from None

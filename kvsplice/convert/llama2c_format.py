"""Reading llama2.c files: the checkpoint ``.bin`` (format v0 legacy header, v1 fp32, v2 int8 group-quantised)
into a config dict and a state dict, with one clear :class:`Llama2cFormatError` for anything malformed."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["Llama2cFormatError", "read_llama2c"]

MAGIC = 0x616B3432  # "ak42" as a little-endian uint32, llama2.c version >= 1 headers
HEADER_V1_BYTES = 256
NORM_EPS = 1e-5
ROPE_THETA = 10000.0
SPIECE_UNDERLINE = "▁"

_LAYER_KEYS = {
    "attention_norm": "layers.{i}.attention_norm.weight",
    "wq": "layers.{i}.attention.wq.weight",
    "wk": "layers.{i}.attention.wk.weight",
    "wv": "layers.{i}.attention.wv.weight",
    "wo": "layers.{i}.attention.wo.weight",
    "ffn_norm": "layers.{i}.ffn_norm.weight",
    "w1": "layers.{i}.feed_forward.w1.weight",
    "w2": "layers.{i}.feed_forward.w2.weight",
    "w3": "layers.{i}.feed_forward.w3.weight",
}


class Llama2cFormatError(ValueError):
    """The file is not a readable llama2.c checkpoint / tokenizer (bad header, wrong size, ...)."""


def read_bytes(path: str | os.PathLike) -> bytes:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no such file: {p}")
    if not p.is_file():
        raise Llama2cFormatError(f"not a regular file: {p}")
    return p.read_bytes()


def _shapes(dim: int, hidden_dim: int, n_layers: int, n_heads: int, n_kv_heads: int, vocab: int) -> dict[str, tuple]:
    head_size = dim // n_heads
    kv_dim = head_size * n_kv_heads
    return {
        "tok_embeddings": (vocab, dim),
        "attention_norm": (n_layers, dim),
        "wq": (n_layers, dim, dim),
        "wk": (n_layers, kv_dim, dim),
        "wv": (n_layers, kv_dim, dim),
        "wo": (n_layers, dim, dim),
        "ffn_norm": (n_layers, dim),
        "w1": (n_layers, hidden_dim, dim),
        "w2": (n_layers, dim, hidden_dim),
        "w3": (n_layers, hidden_dim, dim),
        "norm": (dim,),
        "output": (vocab, dim),
    }


def _numel(shape: tuple) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _parse_header(buf: bytes, path: Path) -> dict[str, Any]:
    if len(buf) < 28:
        raise Llama2cFormatError(f"{path}: file too short for a llama2.c header ({len(buf)} bytes)")
    (first,) = struct.unpack_from("<I", buf, 0)
    if first == MAGIC:
        if len(buf) < HEADER_V1_BYTES:
            raise Llama2cFormatError(f"{path}: truncated llama2.c v1+ header ({len(buf)} < {HEADER_V1_BYTES} bytes)")
        (version,) = struct.unpack_from("<i", buf, 4)
        if version not in (1, 2):
            raise Llama2cFormatError(
                f"{path}: unsupported llama2.c format version {version} (supported: legacy v0, v1, v2)"
            )
        params = struct.unpack_from("<7i", buf, 8)
        shared = bool(buf[36])
        group_size = struct.unpack_from("<i", buf, 37)[0] if version == 2 else None
        header_bytes = HEADER_V1_BYTES
        dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len = params
        if buf[36] not in (0, 1):
            raise Llama2cFormatError(f"{path}: bad shared_classifier flag {buf[36]} in llama2.c v{version} header")
    else:
        version = 0
        params = struct.unpack_from("<7i", buf, 0)
        dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len = params
        shared = vocab_size > 0
        vocab_size = abs(vocab_size)
        group_size = None
        header_bytes = 28

    problems = []
    for name, val in (("dim", dim), ("hidden_dim", hidden_dim), ("n_layers", n_layers), ("n_heads", n_heads),
                      ("n_kv_heads", n_kv_heads), ("vocab_size", vocab_size), ("seq_len", seq_len)):
        if val <= 0 or val > 1 << 24:
            problems.append(f"{name}={val}")
    if not problems:
        if dim % n_heads:
            problems.append(f"dim {dim} not divisible by n_heads {n_heads}")
        elif (dim // n_heads) % 2:
            problems.append(f"odd head size {dim // n_heads}")
        if n_heads % n_kv_heads:
            problems.append(f"n_heads {n_heads} not divisible by n_kv_heads {n_kv_heads}")
    if version == 2 and not problems and (group_size is None or group_size <= 0):
        problems.append(f"group_size={group_size}")
    if problems:
        kind = "legacy (v0, no magic)" if version == 0 else f"v{version}"
        raise Llama2cFormatError(
            f"{path}: not a valid llama2.c {kind} checkpoint header: " + ", ".join(problems)
        )
    return dict(version=version, dim=dim, hidden_dim=hidden_dim, n_layers=n_layers, n_heads=n_heads,
                n_kv_heads=n_kv_heads, vocab_size=vocab_size, max_seq_len=seq_len, shared_classifier=shared,
                group_size=group_size, header_bytes=header_bytes)


class _Cursor:
    def __init__(self, buf: bytes, offset: int):
        self.buf, self.offset = buf, offset

    def f32(self, shape: tuple) -> torch.Tensor:
        n = _numel(shape)
        arr = np.frombuffer(self.buf, dtype="<f4", count=n, offset=self.offset)
        self.offset += 4 * n
        return torch.from_numpy(arr.astype(np.float32)).reshape(shape)  # (*shape)

    def i8(self, n: int) -> np.ndarray:
        arr = np.frombuffer(self.buf, dtype=np.int8, count=n, offset=self.offset)
        self.offset += n
        return arr


def _expected_size(h: dict[str, Any]) -> int:
    s = _shapes(h["dim"], h["hidden_dim"], h["n_layers"], h["n_heads"], h["n_kv_heads"], h["vocab_size"])
    head_size = h["dim"] // h["n_heads"]
    norms = ("attention_norm", "ffn_norm", "norm")
    mats = ["tok_embeddings", "wq", "wk", "wv", "wo", "w1", "w2", "w3"] + ([] if h["shared_classifier"] else ["output"])
    if h["version"] == 0:
        n = sum(_numel(s[k]) for k in norms) + sum(_numel(s[k]) for k in mats)
        n += 2 * h["max_seq_len"] * (head_size // 2)  # freqs_cos, freqs_sin
        return h["header_bytes"] + 4 * n
    if h["version"] == 1:
        return h["header_bytes"] + 4 * (sum(_numel(s[k]) for k in norms) + sum(_numel(s[k]) for k in mats))
    # version 2: int8 values + one float32 scale per group, per tensor
    gs = h["group_size"]
    total = h["header_bytes"] + 4 * sum(_numel(s[k]) for k in norms)
    for k in mats:
        per = _numel(s[k]) if k in ("tok_embeddings", "output") else _numel(s[k][1:])
        if per % gs:
            raise Llama2cFormatError(f"tensor {k} has {per} values, not a multiple of group_size {gs}")
        count = 1 if k in ("tok_embeddings", "output") else h["n_layers"]
        total += count * (per + 4 * (per // gs))
    return total


def read_llama2c(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a llama2.c ``.bin`` checkpoint.

    Returns ``(config, state_dict)``: ``config`` has llama2.c ``ModelArgs`` names (dim, hidden_dim, n_layers,
    n_heads, n_kv_heads, vocab_size, max_seq_len, norm_eps, rope_theta) plus ``shared_classifier``, ``version``
    (0/1/2) and ``group_size`` (v2 only); ``state_dict`` uses llama2.c ``model.py`` keys (float32, llama2.c's
    interleaved-RoPE layout) and contains ``output.weight`` (the same tensor as ``tok_embeddings.weight`` when
    the classifier is shared).

    Raises FileNotFoundError or :class:`Llama2cFormatError` (unknown header, size not matching the header).
    """
    path = Path(path)
    buf = read_bytes(path)
    h = _parse_header(buf, path)
    expected = _expected_size(h)
    if len(buf) != expected:
        what = "truncated" if len(buf) < expected else "has trailing data / wrong header"
        raise Llama2cFormatError(
            f"{path}: file size {len(buf)} bytes does not match its llama2.c v{h['version']} header "
            f"(expected {expected} bytes for dim={h['dim']}, n_layers={h['n_layers']}, vocab={h['vocab_size']}); "
            f"file is {what}"
        )
    L = h["n_layers"]
    s = _shapes(h["dim"], h["hidden_dim"], L, h["n_heads"], h["n_kv_heads"], h["vocab_size"])
    c = _Cursor(buf, h["header_bytes"])
    t: dict[str, torch.Tensor] = {}
    if h["version"] == 0:
        for k in ("tok_embeddings", "attention_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3", "norm"):
            t[k] = c.f32(s[k])
        half = h["dim"] // h["n_heads"] // 2
        c.f32((h["max_seq_len"], half))  # freqs_cos: recomputed by the model, skipped
        c.f32((h["max_seq_len"], half))  # freqs_sin
        if not h["shared_classifier"]:
            t["output"] = c.f32(s["output"])
    elif h["version"] == 1:
        order = ["attention_norm", "ffn_norm", "norm", "tok_embeddings", "wq", "wk", "wv", "wo", "w1", "w2", "w3"]
        if not h["shared_classifier"]:
            order.append("output")
        for k in order:
            t[k] = c.f32(s[k])
    else:
        for k in ("attention_norm", "ffn_norm", "norm"):
            t[k] = c.f32(s[k])
        gs = h["group_size"]

        def deq(shape: tuple) -> torch.Tensor:
            n = _numel(shape)
            q = c.i8(n).astype(np.float32).reshape(-1, gs)  # (n/gs, gs): one row per quantisation group
            scale = np.frombuffer(buf, dtype="<f4", count=n // gs, offset=c.offset).astype(np.float32)
            c.offset += 4 * (n // gs)
            return torch.from_numpy((q * scale[:, None]).reshape(shape))  # (*shape)

        t["tok_embeddings"] = deq(s["tok_embeddings"])
        for k in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
            t[k] = torch.stack([deq(s[k][1:]) for _ in range(L)])
        if not h["shared_classifier"]:
            t["output"] = deq(s["output"])
    assert c.offset == len(buf), (c.offset, len(buf))

    sd: dict[str, torch.Tensor] = {"tok_embeddings.weight": t["tok_embeddings"]}
    for i in range(L):
        for k, key in _LAYER_KEYS.items():
            sd[key.format(i=i)] = t[k][i].clone()
    sd["norm.weight"] = t["norm"]
    sd["output.weight"] = t["tok_embeddings"] if h["shared_classifier"] else t["output"]

    config = {k: h[k] for k in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                                "max_seq_len", "shared_classifier", "version")}
    config["norm_eps"] = NORM_EPS
    config["rope_theta"] = ROPE_THETA
    if h["version"] == 2:
        config["group_size"] = h["group_size"]
    return config, sd

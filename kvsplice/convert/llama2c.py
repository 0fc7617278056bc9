"""Convert a llama2.c checkpoint (``model.bin`` + ``tokenizer.bin``) into a Hugging Face Llama directory.

Usage::

    python -m kvsplice.convert_llama2c MODEL.bin --tokenizer TOK.bin --out DIR [--force]

The output directory holds ``config.json`` + ``model.safetensors`` (``transformers.LlamaForCausalLM``,
float32) and a ``tokenizer.json`` / ``tokenizer_config.json`` pair that loads with
``transformers.AutoTokenizer.from_pretrained(DIR)``.

Supported model formats (all little-endian, see llama2.c ``export.py``):

* version 0 ("legacy"): 7 x int32 header ``(dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
  seq_len)``; ``vocab_size < 0`` means an untied classifier stored at the end. Then float32 arrays:
  tok_embeddings, attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3 (each stacked over layers), norm,
  freqs_cos, freqs_sin, [output].
* version 1: 256-byte header (uint32 magic ``0x616b3432`` "ak42", int32 version, 7 x int32 params, uint8
  shared_classifier, zero padding), then float32: attention_norm, ffn_norm, norm, tok_embeddings, wq, wk, wv,
  wo, w1, w2, w3, [output]; no RoPE tables.
* version 2 (Q8_0): like version 1 plus an int32 group_size after the flag; the norms are float32, every other
  tensor (tok_embeddings, then per layer wq.., wk.., wv.., wo.., w1.., w2.., w3.., [output]) is stored as its int8
  values immediately followed by its float32 per-group scales (the layout ``runq.c`` reads). Dequantized to float32.

llama2.c applies RoPE to interleaved pairs ``(2j, 2j+1)`` of each head; HF Llama rotates halves
(``j, j + head_dim/2``). The q/k projection rows are permuted exactly as llama2.c's ``hf_export`` does, which makes
the HF model compute the same function.

Tokenizer format (``tokenizer.bin``): int32 max_token_length, then per token float32 score, int32 byte length,
raw bytes. Pieces use a plain space where SentencePiece uses "▁"; ids 0/1/2 are ``<unk>``, ``\\n<s>\\n`` and
``\\n</s>\\n``; byte-fallback pieces are ``<0x00>``..``<0xFF>``. It is rebuilt as a ``tokenizers`` BPE model with
byte fallback whose merges are derived from the pieces ranked by score (SentencePiece BPE semantics).
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "Llama2cFormatError",
    "read_llama2c",
    "read_llama2c_tokenizer",
    "build_tokenizer",
    "llama2c_to_hf_state_dict",
    "make_llama_config",
    "convert_llama2c",
]

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


# ----------------------------------------------------------------------------------------------------------------
# model reading


def _read_bytes(path: str | os.PathLike) -> bytes:
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
        return torch.from_numpy(arr.astype(np.float32)).reshape(shape)

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
    buf = _read_bytes(path)
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
            q = c.i8(n).astype(np.float32).reshape(-1, gs)
            scale = np.frombuffer(buf, dtype="<f4", count=n // gs, offset=c.offset).astype(np.float32)
            c.offset += 4 * (n // gs)
            return torch.from_numpy((q * scale[:, None]).reshape(shape))

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


# ----------------------------------------------------------------------------------------------------------------
# HF conversion


def _permute_rope(w: torch.Tensor, n_heads: int, dim1: int, dim2: int) -> torch.Tensor:
    """Reorder q/k rows from llama2.c's interleaved RoPE pairs to HF's rotate-half layout (llama2.c hf_export)."""
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def make_llama_config(cfg: dict[str, Any]):
    """A ``transformers.LlamaConfig`` for a llama2.c config dict (from :func:`read_llama2c`)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["dim"],
        intermediate_size=cfg["hidden_dim"],
        num_hidden_layers=cfg["n_layers"],
        num_attention_heads=cfg["n_heads"],
        num_key_value_heads=cfg["n_kv_heads"],
        head_dim=cfg["dim"] // cfg["n_heads"],
        max_position_embeddings=cfg["max_seq_len"],
        rms_norm_eps=cfg.get("norm_eps", NORM_EPS),
        # transformers v5: RoPE settings live in `rope_parameters` (a bare `rope_theta=` kwarg is folded into it)
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", ROPE_THETA))},
        tie_word_embeddings=bool(cfg["shared_classifier"]),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        architectures=["LlamaForCausalLM"],
    )


def llama2c_to_hf_state_dict(cfg: dict[str, Any], sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map a llama2.c state_dict to ``LlamaForCausalLM`` keys, permuting wq/wk rows for rotate-half RoPE."""
    dim, n_heads, n_kv = cfg["dim"], cfg["n_heads"], cfg["n_kv_heads"]
    kv_dim = dim // n_heads * n_kv
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"]}
    for i in range(cfg["n_layers"]):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        out[p + "input_layernorm.weight"] = sd[q + "attention_norm.weight"]
        out[p + "self_attn.q_proj.weight"] = _permute_rope(sd[q + "attention.wq.weight"], n_heads, dim, dim)
        out[p + "self_attn.k_proj.weight"] = _permute_rope(sd[q + "attention.wk.weight"], n_kv, kv_dim, dim)
        out[p + "self_attn.v_proj.weight"] = sd[q + "attention.wv.weight"]
        out[p + "self_attn.o_proj.weight"] = sd[q + "attention.wo.weight"]
        out[p + "post_attention_layernorm.weight"] = sd[q + "ffn_norm.weight"]
        out[p + "mlp.gate_proj.weight"] = sd[q + "feed_forward.w1.weight"]
        out[p + "mlp.down_proj.weight"] = sd[q + "feed_forward.w2.weight"]
        out[p + "mlp.up_proj.weight"] = sd[q + "feed_forward.w3.weight"]
    out["lm_head.weight"] = out["model.embed_tokens.weight"] if cfg["shared_classifier"] else sd["output.weight"]
    return {k: v.contiguous().to(torch.float32) for k, v in out.items()}


def _build_hf_model(cfg: dict[str, Any], sd: dict[str, torch.Tensor]):
    from transformers import LlamaForCausalLM

    config = make_llama_config(cfg)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    hf_sd = llama2c_to_hf_state_dict(cfg, sd)
    if cfg["shared_classifier"]:
        hf_sd.pop("lm_head.weight")
    missing, unexpected = model.load_state_dict(hf_sd, strict=False)
    missing = [k for k in missing if not (cfg["shared_classifier"] and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"state_dict mismatch: missing={missing} unexpected={unexpected}")
    if cfg["shared_classifier"]:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.eval()
    return model


# ----------------------------------------------------------------------------------------------------------------
# tokenizer


def read_llama2c_tokenizer(path: str | os.PathLike) -> tuple[list[bytes], list[float], int]:
    """Read a llama2.c ``tokenizer.bin``: returns ``(pieces as raw bytes, scores, max_token_length)``.

    The vocabulary size is not stored in the file; it is the number of records up to the end of the file.
    """
    path = Path(path)
    buf = _read_bytes(path)
    if len(buf) < 4:
        raise Llama2cFormatError(f"{path}: file too short for a llama2.c tokenizer ({len(buf)} bytes)")
    (max_len,) = struct.unpack_from("<i", buf, 0)
    if not 0 < max_len <= 4096:
        raise Llama2cFormatError(f"{path}: bad max_token_length {max_len} in llama2.c tokenizer header")
    pieces, scores, off = [], [], 4
    while off < len(buf):
        if off + 8 > len(buf):
            raise Llama2cFormatError(f"{path}: truncated tokenizer record {len(pieces)} at byte {off}")
        score, n = struct.unpack_from("<fi", buf, off)
        off += 8
        if n < 0 or n > max_len or off + n > len(buf):
            raise Llama2cFormatError(
                f"{path}: corrupt/truncated tokenizer record {len(pieces)} at byte {off - 8} "
                f"(length {n}, max_token_length {max_len}, {len(buf) - off} bytes left)"
            )
        pieces.append(buf[off:off + n])
        scores.append(float(score))
        off += n
    if len(pieces) < 3:
        raise Llama2cFormatError(f"{path}: tokenizer has only {len(pieces)} tokens")
    return pieces, scores, max_len


def _hf_piece(raw: bytes, idx: int, path: Any = "tokenizer") -> str:
    if idx == 1 and raw.strip() == b"<s>":
        return "<s>"
    if idx == 2 and raw.strip() == b"</s>":
        return "</s>"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Llama2cFormatError(f"{path}: token {idx} {raw!r} is not valid UTF-8 ({e})") from None
    return text.replace(" ", SPIECE_UNDERLINE)


def build_tokenizer(pieces: list[bytes], scores: list[float], model_max_length: int | None = None, path: Any = "tokenizer"):
    """Build a ``PreTrainedTokenizerFast`` equivalent to llama2.c's (SentencePiece-style) BPE tokenizer.

    * vocab: pieces with " " -> "▁"; ids 0/1/2 become ``<unk>``/``<s>``/``</s>`` (special tokens);
    * merges: every split ``(a, b)`` of a multi-character piece ``a + b`` with both halves in the vocab,
      ranked by the merged piece's score (highest first) -- SentencePiece BPE merges the best-scoring adjacent
      pair, which is what llama2.c ``run.c`` ``encode`` does;
    * normalizer: prepend one "▁" (run.c's dummy prefix), spaces -> "▁"; no pre-tokenizer (run.c encodes the
      whole text as one sequence). Text after a special token written inside the string (e.g. "a</s>b") gets its
      own dummy prefix, as the legacy HF Llama tokenizer did;
    * byte fallback to ``<0xNN>`` for characters outside the vocab; BOS is prepended on encode;
    * decoder: "▁" -> " ", byte fallback, fuse, strip one leading space.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    strs = [_hf_piece(p, i, path) for i, p in enumerate(pieces)]
    vocab: dict[str, int] = {}
    for i, s in enumerate(strs):
        if s in vocab:
            raise Llama2cFormatError(f"{path}: duplicate token {s!r} at ids {vocab[s]} and {i}")
        vocab[s] = i
    if strs[0] != "<unk>":
        raise Llama2cFormatError(f"{path}: expected token 0 to be <unk>, got {strs[0]!r}")
    specials = {0, 1, 2}
    byte_pieces = {f"<0x{b:02X}>" for b in range(256)}
    missing_bytes = byte_pieces - vocab.keys()
    if missing_bytes:
        raise Llama2cFormatError(f"{path}: {len(missing_bytes)} byte-fallback pieces <0xNN> missing from the vocab")

    merges: list[tuple[float, int, int, int, tuple[str, str]]] = []
    for i, s in enumerate(strs):
        if i in specials or s in byte_pieces or len(s) < 2:
            continue
        for k in range(1, len(s)):
            a, b = s[:k], s[k:]
            ia, ib = vocab.get(a), vocab.get(b)
            if ia is None or ib is None or ia in specials or ib in specials:
                continue
            merges.append((-scores[i], i, ia, ib, (a, b)))
    merges.sort()

    tok = Tokenizer(BPE(vocab=vocab, merges=[m[-1] for m in merges], unk_token="<unk>", fuse_unk=True,
                        byte_fallback=True, dropout=None))
    # run.c / SentencePiece: always prepend one dummy "▁" (even before a leading space), spaces -> "▁", and run
    # BPE over the whole text (no whitespace pre-split). A Metaspace pre-tokenizer would skip the dummy prefix
    # when the text already starts with a space, which breaks parity with run.c and the decode round trip.
    tok.normalizer = normalizers.Sequence([
        normalizers.Prepend(SPIECE_UNDERLINE),
        normalizers.Replace(" ", SPIECE_UNDERLINE),
    ])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([
        decoders.Replace(SPIECE_UNDERLINE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
        decoders.Strip(content=" ", left=1, right=0),
    ])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    kwargs = {}
    if model_max_length:
        kwargs["model_max_length"] = int(model_max_length)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        padding_side="left",
        **kwargs,
    )


# ----------------------------------------------------------------------------------------------------------------
# conversion + CLI


def _count_params(model) -> int:
    seen, n = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            n += p.numel()
    return n


def convert_llama2c(model_path: str | os.PathLike, tokenizer_path: str | os.PathLike | None,
                    out_dir: str | os.PathLike, force: bool = False) -> Path:
    """Convert ``model_path`` (+ ``tokenizer_path``; ``None`` skips the tokenizer) into an HF directory ``out_dir``.

    Everything is read and validated before anything is written; files are written to a temporary directory next
    to ``out_dir`` and then moved in. Refuses a non-empty ``out_dir`` unless ``force`` (then same-named files are
    overwritten, other files are left alone). Returns ``out_dir`` as a Path.
    """
    return _convert(model_path, tokenizer_path, out_dir, force)[0]


def _convert(model_path, tokenizer_path, out_dir, force):
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output path exists and is not a directory: {out}")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"output directory {out} exists and is not empty (use --force to overwrite)")

    cfg, sd = read_llama2c(model_path)
    tokenizer = None
    if tokenizer_path is not None:
        pieces, scores, _ = read_llama2c_tokenizer(tokenizer_path)
        if len(pieces) != cfg["vocab_size"]:
            raise Llama2cFormatError(
                f"{tokenizer_path}: tokenizer has {len(pieces)} tokens but the model's vocab_size is {cfg['vocab_size']}"
            )
        tokenizer = build_tokenizer(pieces, scores, model_max_length=cfg["max_seq_len"], path=tokenizer_path)
    model = _build_hf_model(cfg, sd)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        out.mkdir(exist_ok=True)
        umask = os.umask(0)
        os.umask(umask)
        for f in sorted(tmp.iterdir()):
            if f.is_file():
                f.chmod(0o666 & ~umask)  # some writers create 0600 temp files
            dest = out / f.name
            if dest.is_dir() and not dest.is_symlink():
                shutil.rmtree(dest)
            os.replace(f, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, cfg, _count_params(model)

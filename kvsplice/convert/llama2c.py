"""Convert a llama2.c checkpoint (``model.bin`` + ``tokenizer.bin``) into a Hugging Face Llama directory.

Usage::

    kvsplice convert-llama2c MODEL.bin --tokenizer TOK.bin --out DIR [--force]

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from kvsplice.convert.llama2c_format import NORM_EPS, ROPE_THETA, Llama2cFormatError, read_llama2c
from kvsplice.convert.llama2c_tokenizer import build_tokenizer, read_llama2c_tokenizer
from kvsplice.io.options import opt
from kvsplice.io.run_options import ForceOption

__all__ = [
    "Llama2cFormatError",
    "Llama2cOptions",
    "read_llama2c",
    "read_llama2c_tokenizer",
    "build_tokenizer",
    "llama2c_to_hf_state_dict",
    "make_llama_config",
    "convert_llama2c",
    "convert_options",
]

# ----------------------------------------------------------------------------------------------------------------
# HF conversion


def _permute_rope(w: torch.Tensor, n_heads: int, dim1: int, dim2: int) -> torch.Tensor:
    """Reorder q/k rows from llama2.c's interleaved RoPE pairs to HF's rotate-half layout (llama2.c hf_export)."""
    # (H, dim1/H/2, 2, dim2) → (H, 2, dim1/H/2, dim2) → (dim1, dim2)
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

    Everything is read and validated before anything is written; files are written to a temporary directory and
    then moved in (:func:`kvsplice.io.folders.write_dir`) with the folder's marker. Refuses a non-empty ``out_dir``
    unless ``force`` (then the files of an earlier conversion are replaced, other files are left alone; a full disk
    is one line and leaves the folder as it was) and an ``out_dir`` holding an input
    (:class:`kvsplice.io.cli.UsageError`). Returns ``out_dir`` resolved.
    """
    return _convert(model_path, tokenizer_path, out_dir, force)[0]


@dataclass(frozen=True, kw_only=True)
class Llama2cOptions(ForceOption):
    """What ``kvsplice convert-llama2c`` converts (:func:`convert_llama2c`'s arguments): the fields declare the
    command line (:mod:`kvsplice.io.options`)."""

    model: str = opt(flags=("model",), help="llama2.c model .bin (e.g. stories260K.bin)")
    tokenizer: Optional[str] = opt(None, help="llama2.c tokenizer .bin (e.g. tok512.bin); omit to convert weights "
                                   "only")
    out: str = opt(help="output directory")


def convert_options(opts: Llama2cOptions) -> tuple[Path, dict[str, Any], int]:
    """:func:`convert_llama2c` of ``opts``; returns ``(the folder, the llama2.c header, the parameter count)``."""
    return _convert(opts.model, opts.tokenizer, opts.out, opts.force)


WRITER = "convert_llama2c"
"""The writer the folder's marker names (:data:`kvsplice.io.marker.MARKER`): another tool's ``--force`` refuses the
folder; this one's replaces its own earlier files and keeps the others."""


def _convert(model_path, tokenizer_path, out_dir, force):
    from kvsplice.io.claims import release_claim
    from kvsplice.io.folders import output_dir

    out = output_dir(out_dir, force=force, inputs={"model": model_path, "--tokenizer": tokenizer_path},
                     writer=WRITER)
    try:
        return _write(model_path, tokenizer_path, out)
    finally:
        release_claim(out)  # a library call leaves no .claim file beside its output


def _write(model_path, tokenizer_path, out):
    from kvsplice.io.folders import write_dir

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

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)

    write_dir(out, fill, writer=WRITER)
    return out, cfg, _count_params(model)

"""``model_fingerprint``: a short hash of a model's architecture and attention weights, stored in bases files."""

from __future__ import annotations

import hashlib
import json
from dataclasses import fields
from typing import Any

import torch
from torch import nn

from kvsplice.adapters.registry import adapter_for

_ARCH_KEYS = ("vocab_size", "hidden_size", "n_embd", "num_hidden_layers", "n_layer", "num_attention_heads",
              "n_head", "num_key_value_heads", "head_dim", "max_position_embeddings", "n_positions",
              "rope_parameters", "rope_theta", "rope_scaling", "attention_bias", "partial_rotary_factor",
              "layer_types", "sliding_window", "query_pre_attn_scalar", "rope_local_base_freq")


def _sample_bytes(t: torch.Tensor, n: int = 1024) -> bytes:
    flat = t.detach().reshape(-1)  # (numel,)
    step = max(1, flat.numel() // n)
    # float16 bytes: the same weights cast to fp16 (e.g. for GPU inference) keep their fingerprint
    return flat[::step][:n].to("cpu", torch.float16).numpy().tobytes()


def model_fingerprint(model: nn.Module) -> str:
    """A short hash identifying ``model``'s architecture and weights, stored in the bases metadata.

    Hashes the family, the attention shapes, the architecture/RoPE config fields, and strided samples (≤1024
    values) of the token embedding and every layer's q/k/v/o weights rounded to float16 — so a float32 model and
    its float16 cast share a fingerprint, while a different checkpoint (or different RoPE settings) does not.
    """
    adapter = adapter_for(model)
    own = adapter.name == "mla_llama"  # a converted MLA model: no q/k/v/o projections, its attention's own weights
    if not own:
        adapter.require_projections()
    info = adapter.info()
    arch: dict[str, Any] = {f.name: getattr(info, f.name) for f in fields(info)}
    if info.family not in ("gpt", "mla_llama"):  # a transformers model
        cfg = adapter.config.to_dict() if hasattr(adapter, "config") else model.config.to_dict()
        arch.update({k: cfg[k] for k in _ARCH_KEYS if k in cfg})
    else:
        cfg = model.cfg.to_dict()
        arch.update({k: v for k, v in cfg.items() if k not in ("attn_backend", "mla_impl", "dropout", "cache_quant", "decode_kernel")})
    h = hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode())
    h.update(_sample_bytes(adapter.param()))  # the token embedding
    for layer in range(info.n_layer):
        if own:
            for _, w in sorted(adapter.attention_module(layer).named_parameters()):
                h.update(_sample_bytes(w))
            continue
        P = adapter.proj(layer)
        for w in (P.wq, P.wk, P.wv, P.wo):
            h.update(_sample_bytes(w))
    return f"{info.family}-{h.hexdigest()[:16]}"



"""Error diagnostics of global low-rank bases against the bounds of :mod:`kvsplice.core.bounds`
(:func:`kvsplice.core.diagnostics.attention_diagnostics` per layer, on the exact model's q/k/v)."""

from __future__ import annotations

import torch
from torch import nn

from kvsplice.adapters import adapter_for, apply_rope
from kvsplice.adapters.capture import extract_qkv
from kvsplice.lowrank.bases import KVBases
from kvsplice.core.diagnostics import attention_diagnostics

__all__ = ["bases_diagnostics"]


@torch.no_grad()
def bases_diagnostics(model: nn.Module, bases: KVBases, input_ids: torch.Tensor) -> list[dict]:
    """Diagnostics of global bases on ``input_ids``: exact ``q, k, v`` from
    :func:`~kvsplice.adapters.capture.extract_qkv` (in the bases' RoPE mode), ``k̂ = k k_enc k_decᵀ`` (exactly the
    coefficient logits ``(q k_dec)·(k k_enc)`` for oblique pairs too), ``v̂ = v v_enc v_decᵀ``; for pre-RoPE bases
    ``q``, ``k`` and ``k̂`` are rotated after the rebuild. Returns one :func:`attention_diagnostics` dict per layer."""
    fam = adapter_for(model)
    if bases.n_layer != fam.n_layer or bases.n_kv_head != fam.n_kv_head:
        raise ValueError(f"bases ({bases.n_layer} layers × {bases.n_kv_head} KV heads) do not fit the model "
                         f"({fam.n_layer} × {fam.n_kv_head})")
    mode = bases.rope if fam.has_rope else "none"
    qkv = extract_qkv(model, input_ids, rope="pre" if mode == "pre" else ("post" if fam.has_rope else None))
    out = []
    for l, x in enumerate(qkv):
        heads = bases.layers[l]
        k, v, q = x["k"].double(), x["v"].double(), x["q"].double()
        k_hat = torch.stack([k[:, j] @ (h.k_enc.double() @ h.k_dec.double().T) for j, h in enumerate(heads)], 1)
        v_hat = torch.stack([v[:, j] @ (h.v_enc.double() @ h.v_dec.double().T) for j, h in enumerate(heads)], 1)
        if mode == "pre":
            cos, sin = (r.double() for r in fam.rope(q, 0, input_ids.shape[1], layer=l))  # (1, T, D): layer l's
            q, k, k_hat = (apply_rope(y, cos, sin) for y in (q, k, k_hat))
        out.append(attention_diagnostics(q, k, v, k_hat, v_hat, fam.scale(l)))
    return out

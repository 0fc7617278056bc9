"""Capture every layer's queries, keys and values of a model's own forward pass through the adapter's hooks:
:func:`run_with_qkv_hooks` streams them to a sink (calibration Grams), :func:`extract_qkv` keeps one batch's."""

from __future__ import annotations

from typing import Iterable, Literal, Optional

import torch
from torch import nn
from tqdm.auto import tqdm

from kvsplice.adapters.base import FamilyAdapter, ModelInfo, Sink
from kvsplice.adapters.registry import adapter_for

__all__ = ["RopeMode", "extract_qkv", "resolve_rope", "run_with_qkv_hooks"]

RopeMode = Literal["post", "pre", "none"]


def resolve_rope(info: ModelInfo, rope: Optional[str]) -> RopeMode:
    if not info.has_rope:
        return "none"  # no rotary embedding: pre == post
    rope = rope or "post"
    if rope not in ("post", "pre"):
        raise ValueError(f"rope must be 'post' or 'pre' for a rotary model ({info.family}), got {rope!r}")
    return rope  # type: ignore[return-value]


def run_with_qkv_hooks(model: nn.Module, adapter: FamilyAdapter, rope: RopeMode, sink: Sink, batches: Iterable[torch.Tensor],
         progress: bool, total: Optional[int], desc: str) -> int:
    """Forward every batch with the adapter's q/k/v hooks attached (``sink`` gets every layer's tensors); returns the
    number of tokens seen. Eval mode and ``no_grad`` for the pass; every hook is removed afterwards."""
    if rope == "pre" and adapter.rotary_dim != adapter.head_dim:
        raise ValueError(f"pre-RoPE bases need a rotary over the whole head: this {adapter.name} model rotates "
                         f"{adapter.rotary_dim} of {adapter.head_dim} dims (partial_rotary_factor); use --rope post")
    handles = adapter.attach_qkv_hooks(sink, rope)
    fwd = adapter.base_forward  # the model's own forward (no LM head for HF models)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    n_tokens = 0
    if total is None and hasattr(batches, "__len__"):
        total = len(batches)  # type: ignore[arg-type]
    try:
        with torch.no_grad():
            for batch in tqdm(batches, total=total, desc=desc, unit="batch", disable=not progress):
                batch = torch.as_tensor(batch)
                if batch.dim() == 1:
                    batch = batch[None]
                if batch.dim() != 2 or batch.dtype not in (torch.int64, torch.int32):
                    raise ValueError(f"calibration batches must be integer token ids (B, T), got "
                                     f"{tuple(batch.shape)} {batch.dtype}")
                fwd(batch.to(device=device, dtype=torch.long))
                n_tokens += batch.numel()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return n_tokens


def extract_qkv(model: nn.Module, input_ids: torch.Tensor, *, rope: Optional[RopeMode] = None
                ) -> list[dict[str, torch.Tensor]]:
    """The per-layer queries, keys and values the calibration hooks see for one batch ``input_ids (B, T)``, in the
    attention layout: ``[{"q": (B, Hq, T, d), "k": (B, Hkv, T, d), "v": (B, Hkv, T, d)}, ...]`` (for tests and
    evaluation on held-out text; this keeps activations, :func:`calibrate` does not)."""
    adapter = adapter_for(model)
    adapter.require_projections()
    info = adapter.info()
    rope_mode = resolve_rope(info, rope)
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(info.n_layer)]

    def sink(layer: int, kind: str, x: torch.Tensor) -> None:
        out[layer][kind] = x.detach().clone()

    run_with_qkv_hooks(model, adapter, rope_mode, sink, [input_ids], progress=False, total=1, desc="extract")
    return out

"""What every compression method needs from a model, once: :class:`FamilyAdapter`.

An adapter runs a supported model's own submodules (embeddings, norms, MLPs, rotary tables, LM head) so that a
decoder can do the attention itself, layer by layer, and hands out each layer's attention projections in
``nn.Linear`` layout. Tensors a method sees are in the attention layout ``(B, H, T, d)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from models.rope import rotate

SUPPORTED_FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "gemma3")
"""The ``config.model_type`` of the transformers causal LMs (``*ForCausalLM``, or the bare ``*Model``) every
post-training method supports; besides them, ``models.GPT`` with ``attention='mha'``."""

Sink = Callable[[int, str, torch.Tensor], None]
"""``sink(layer, kind, x)`` with kind ``q`` (x ``(B, Hq, T, d)``), ``k`` or ``v`` (``(B, Hkv, T, d)``)."""


def unsupported(model: object, why: str = "") -> ValueError:
    """The one error for a model no adapter (or no post-training method) supports: one line (it fits the CLIs'
    300-character error lines) naming the supported families."""
    name = type(model).__name__
    mt = getattr(getattr(model, "config", None), "model_type", None)
    return ValueError(f"unsupported model {name}{f' (model_type={mt!r})' if mt else ''} (unsupported model family"
                      f"{': ' + why if why else ''}); supported: transformers model_type "
                      f"{', '.join(SUPPORTED_FAMILIES)}; models.GPT (attention='mha')")


@dataclass(frozen=True)
class ModelInfo:
    """Attention shapes of a supported model. ``family`` is ``llama`` (HF), ``gpt2`` (HF) or ``gpt`` (ours)."""

    family: str
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    d_model: int
    has_rope: bool

    @property
    def group_size(self) -> int:
        return self.n_head // self.n_kv_head


@dataclass
class Projections:
    """A layer's attention projections in ``nn.Linear`` convention (``y = x Wᵀ + b``); views of the model's."""

    wq: torch.Tensor  # (Hq·D, d_model)
    bq: Optional[torch.Tensor]
    wk: torch.Tensor  # (Hkv·D, d_model)
    bk: Optional[torch.Tensor]
    wv: torch.Tensor  # (Hkv·D, d_model)
    bv: Optional[torch.Tensor]
    wo: torch.Tensor  # (d_model, Hq·D)
    bo: Optional[torch.Tensor]


# ---------------------------------------------------------------------------------------------- layouts
def split_heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """(B, T, H·D) → (B, H, T, D)."""
    b, t, _ = x.shape
    return x.view(b, t, n_head, -1).transpose(1, 2)  # (B, H, T, D)


def merge_heads(z: torch.Tensor) -> torch.Tensor:
    """(B, H, T, R) → (B, T, H·R), head-major."""
    b, h, t, r = z.shape
    return z.transpose(1, 2).reshape(b, t, h * r)  # (B, T, H·R)


# ------------------------------------------------------------------------------------------------- RoPE
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x (B, H, T, D)`` at the positions of ``cos, sin (1 or B, T, r)``; ``r < D`` (partial rotary, e.g.
    Phi-3 with ``partial_rotary_factor < 1``) rotates the first ``r`` dims and passes the rest through."""
    cos, sin = cos[:, None], sin[:, None]  # (·, 1, T, r): broadcast over heads
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return rotate(x, cos, sin)
    return torch.cat([rotate(x[..., :r], cos, sin), x[..., r:]], dim=-1)


# ---------------------------------------------------------------------------------------------- adapter
class FamilyAdapter:
    """Shapes, the non-attention submodules, projections and RoPE of one model family.

    Decoding: ``embed`` → per layer ``attn_in`` → (the method's attention) → ``after_attn`` → ``head``.
    Calibration: ``attach_qkv_hooks`` + ``base_forward`` (the model's own forward, no LM head).
    """

    name: str
    has_rope: bool = False
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    d_model: int
    max_positions: Optional[int] = None
    model: nn.Module
    block_parts: tuple[str, str, str, str] = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    """Names in a pre-norm block ``x + attn(attn_norm x)``, then ``x + mlp(mlp_norm x)``: attn_norm, attn,
    mlp_norm, mlp (the Llama layout's; each family names its own)."""

    # ------------------------------------------------------------------------------------------- shapes
    def info(self) -> ModelInfo:
        return ModelInfo(self.name, self.n_layer, self.n_head, self.n_kv_head, self.head_dim, self.d_model,
                         self.has_rope)

    def param(self) -> torch.Tensor:
        """A parameter that tells the model's dtype and device (the token embedding)."""
        raise NotImplementedError

    def check_room(self, cache_batch: int, position: int, b: int, t: int) -> None:
        """``b`` sequences of ``t`` new tokens may go into a cache for ``cache_batch`` sequences whose next
        position is ``position``: same batch size, and within the model's positions."""
        if cache_batch != b:
            raise ValueError(f"cache was built for batch size {cache_batch}, got a batch of {b}")
        mp = self.max_positions
        if mp is not None and position + t > mp:
            raise ValueError(f"sequence of {position + t} tokens ({position} cached + {t} new) exceeds the model's "
                             f"{mp} positions")

    def require_projections(self) -> None:
        """Raise unless per-layer q/k/v/o projections exist (post-training methods need them)."""

    # ---------------------------------------------------------------------------------------- submodules
    def embed(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        raise NotImplementedError

    def blocks(self) -> nn.ModuleList:
        """The model's decoder blocks, in order."""
        raise NotImplementedError

    def attn_in(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The input of ``layer``'s attention: its pre-attention norm of the residual stream ``x (B, T, d_model)``."""
        return getattr(self.blocks()[layer], self.block_parts[0])(x)

    def attention_module(self, layer: int) -> nn.Module:
        return getattr(self.blocks()[layer], self.block_parts[1])

    def after_attn(self, layer: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The rest of ``layer``'s block: the residual ``x + y`` of the attention output ``y``, then the MLP's."""
        block, (_, _, norm, mlp) = self.blocks()[layer], self.block_parts
        x = x + y
        return x + getattr(block, mlp)(getattr(block, norm)(x))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def proj(self, layer: int) -> Projections:
        raise NotImplementedError

    def scale(self, layer: int) -> float:
        raise NotImplementedError

    def window(self, layer: int) -> Optional[int]:
        """The sliding window of ``layer`` (transformers' convention: a query sees itself and the ``window - 1``
        tokens before it), or ``None`` for full causal attention."""
        return None

    def rotary_embedding(self, layer: int = 0) -> Optional[Callable]:
        """``layer``'s rotary module, ``rotary(x, positions (B or 1, T)) -> cos, sin (B or 1, T, r)`` (methods that
        keep pre-RoPE numbers build their tables from it; layers that share RoPE share the object); ``None``
        without RoPE."""
        return None

    @property
    def rotary_dim(self) -> int:
        """Dims of a head the rotary embedding rotates (``head_dim`` unless partial rotary)."""
        return self.head_dim

    def rope(self, x: torch.Tensor, start: int, t: int, layer: Optional[int] = None):
        """RoPE tables of positions ``start .. start + t - 1``: with ``layer``, that layer's ``cos, sin (1, t, r)``;
        without, the tables of every layer for :meth:`qkv` (one ``(cos, sin)`` when all layers share them, else a
        list per layer, computed once per distinct rotary). ``None`` without RoPE."""
        if not self.has_rope:
            return None
        pos = torch.arange(start, start + t, device=x.device)[None]  # (1, t)
        if layer is not None:
            return self.rotary_embedding(layer)(x, pos)
        rots = [self.rotary_embedding(l) for l in range(self.n_layer)]
        if all(r is rots[0] for r in rots):
            return rots[0](x, pos)
        tables: dict[int, tuple] = {}
        for r in rots:
            if id(r) not in tables:
                tables[id(r)] = r(x, pos)
        return [tables[id(r)] for r in rots]

    @staticmethod
    def layer_rope(layer: int, tables):
        """``layer``'s ``(cos, sin)`` from what :meth:`rope` returned for every layer."""
        return tables[layer] if isinstance(tables, list) else tables

    def head_norm(self, layer: int, kind: str, x: torch.Tensor) -> torch.Tensor:
        """The per-head norm a family applies to projected ``q`` / ``k`` ``(B, H, T, D)`` before RoPE (Qwen3,
        Gemma-3: RMSNorm over the head dim); identity here."""
        return x

    # ------------------------------------------------------------------------------------------- shared
    def qkv(self, layer: int, h: torch.Tensor, rope=None, *, rotate_k: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q (B, Hq, T, D)``, ``k, v (B, Hkv, T, D)`` from the original weights (and the family's per-head norms);
        with ``rope`` (what :meth:`rope` returned) ``q`` is rotated, and ``k`` too unless ``rotate_k=False``
        (pre-RoPE keys)."""
        P = self.proj(layer)
        q = self.head_norm(layer, "q", split_heads(F.linear(h, P.wq, P.bq), self.n_head))  # (B, Hq, T, D)
        k = self.head_norm(layer, "k", split_heads(F.linear(h, P.wk, P.bk), self.n_kv_head))  # (B, Hkv, T, D)
        v = split_heads(F.linear(h, P.wv, P.bv), self.n_kv_head)  # (B, Hkv, T, D)
        if rope is not None:
            rope = self.layer_rope(layer, rope)
            q = apply_rope(q, *rope)
            if rotate_k:
                k = apply_rope(k, *rope)
        return q, k, v

    def out(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        """Head outputs ``z (B, Hq, T, D)`` → the attention block's output ``(B, T, d_model)``."""
        P = self.proj(layer)
        return F.linear(merge_heads(z), P.wo, P.bo)

    # -------------------------------------------------------------------------------------- calibration
    def base_forward(self, ids: torch.Tensor) -> None:
        """The model's own forward over ``ids`` without the LM head (hooks see every layer's q/k/v)."""
        raise NotImplementedError

    def attach_qkv_hooks(self, sink: Sink, rope: str) -> list:
        """Forward hooks that hand each layer's ``q, k, v`` (attention layout, ``rope``: ``post`` rotated,
        ``pre``/``none`` not) to ``sink``; returns the handles (remove them afterwards)."""
        raise NotImplementedError

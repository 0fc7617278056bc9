"""HF GPT-2 (``GPT2LMHeadModel`` / ``GPT2Model``, Conv1D weights) and our ``models.GPT`` (nn.Linear): same names."""

from __future__ import annotations

import torch
from torch import nn

from kvsplice.adapters.base import FamilyAdapter, Projections, Sink, unsupported


class GPT2Adapter(FamilyAdapter):
    """``hf=True``: HF GPT-2 (``model`` may be the bare ``GPT2Model``, then there is no LM head); ``hf=False``: ours
    (any attention; MLA models decode with their own attention module only)."""

    block_parts = ("ln_1", "attn", "ln_2", "mlp")

    def __init__(self, model: nn.Module, *, hf: bool) -> None:
        self.model, self.hf = model, hf
        self.t = model.transformer if hasattr(model, "transformer") else model  # GPT2Model is the transformer
        if hf:
            cfg = model.config
            if getattr(cfg, "add_cross_attention", False):
                raise unsupported(model, "GPT-2 with cross-attention (add_cross_attention=True)")
            self.name, self.n_layer, self.n_head = "gpt2", cfg.n_layer, cfg.n_head
            self.d_model, self.head_dim = cfg.n_embd, cfg.n_embd // cfg.n_head
            self.max_positions = cfg.n_positions
            self.attention, self.layout = "mha", "gpt2"
            self.n_kv_head = self.n_head
        else:
            cfg = model.cfg
            self.name, self.n_layer, self.n_head = "gpt", cfg.n_layer, cfg.n_head
            self.d_model, self.head_dim, self.max_positions = cfg.d_model, cfg.head_size, cfg.block_size
            self.attention = cfg.attention
            self.layout = cfg.layout
            self.n_kv_head = cfg.kv_heads  # grouped-query / multi-query models.GPT
        self.qkv_sizes = [self.d_model] + [self.n_kv_head * self.head_dim] * 2  # c_attn's q | k | v rows

    def require_projections(self) -> None:
        if not self.hf and self.layout != "gpt2":
            raise unsupported(self.model, f"models.GPT with layout={self.layout!r} (RoPE): export it with "
                                          f"--format llama for post-training methods")
        if self.attention != "mha":
            raise unsupported(self.model, f"models.GPT with attention={self.attention!r} (its cache is already a "
                                          f"latent; post-training methods need an MHA model, attention='mha')")

    def param(self):
        return self.t.wte.weight

    def embed(self, ids, start):
        x = self.t.wte(ids)  # (B, T, d_model); dropout skipped: inference only
        if getattr(self.t, "wpe", None) is None:  # models.GPT in the deepseek_v3 layout: its attention rotates
            return x
        pos = torch.arange(start, start + ids.shape[1], device=ids.device)  # (T,)
        return x + self.t.wpe(pos)[None]

    def blocks(self):
        return self.t.h

    def head(self, x):
        if not hasattr(self.model, "lm_head"):
            raise ValueError("decoding needs the LM head: pass GPT2LMHeadModel, not the bare GPT2Model")
        return self.model.lm_head(self.t.ln_f(x))

    def proj(self, layer):
        self.require_projections()
        attn = self.t.h[layer].attn
        w, b = attn.c_attn.weight, attn.c_attn.bias
        wo, bo = attn.c_proj.weight, attn.c_proj.bias
        if self.hf:  # Conv1D stores (in, out)
            w, wo = w.T, wo.T
        wq, wk, wv = w.split(self.qkv_sizes, dim=0)  # (d_model, d_model), 2 × (Hkv·d, d_model)
        bq, bk, bv = b.split(self.qkv_sizes) if b is not None else (None, None, None)
        return Projections(wq, bq, wk, bk, wv, bv, wo, bo)

    def scale(self, layer):
        attn = self.t.h[layer].attn
        if not self.hf:
            return float(attn.scale)
        if hasattr(attn, "scaling"):
            return float(attn.scaling)
        # transformers 4.56 – 5.2 keep no ``scaling``: only their eager attention applies scale_attn_weights and
        # scale_attn_by_inverse_layer_idx; every other attention function gets the default 1/sqrt(head_dim)
        if self.model.config._attn_implementation != "eager":
            return self.head_dim ** -0.5
        s = self.head_dim ** -0.5 if attn.scale_attn_weights else 1.0
        return s / (attn.layer_idx + 1) if attn.scale_attn_by_inverse_layer_idx else s

    def base_forward(self, ids):
        if self.hf:
            self.t(input_ids=ids, use_cache=False)
        else:
            self.model(ids)

    def attach_qkv_hooks(self, sink: Sink, rope: str) -> list:
        self.require_projections()
        handles = []
        for i, block in enumerate(self.t.h):
            def hook(mod, inp, out, i=i):
                q, k, v = out.split(self.qkv_sizes, dim=-1)  # (B, T, d_model), 2 × (B, T, Hkv·d)
                for kind, x in (("q", q), ("k", k), ("v", v)):
                    sink(i, kind, x.view(*x.shape[:-1], -1, self.head_dim).transpose(1, 2))  # (B, H or Hkv, T, d)
            handles.append(block.attn.c_attn.register_forward_hook(hook))
        return handles

"""GPT: embeddings, blocks (GPT-2 or DeepSeek-V3 layout), head; cached decode (``new_cache`` / ``generate``) and HF GPT-2 weight import."""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import CausalSelfAttention, dropout
from models.latent_attention import MultiHeadLatentAttention
from models.config import DEEPSEEK_V3, GPT2, RMS_NORM_EPS, GPTConfig
from models.generate import check_prompt, check_sampling, generate_tokens, sample_next
from models.splice import LearnedKVSplice
from models.stream_cache import CompressedLatentCache, DecodeCache, KVCache, LatentCache

__all__ = ["GPT", "sample_next"]


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new"
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class SwiGLU(nn.Module):
    """The DeepSeek-V3 / Llama MLP: ``down_proj(silu(gate_proj x) · up_proj x)``, ``d_ff`` wide, no biases."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ff_width, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ff_width, bias=False)
        self.down_proj = nn.Linear(cfg.ff_width, cfg.d_model, bias=False)
        self.dropout = dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


def norm(cfg: GPTConfig) -> nn.Module:
    """The layout's block norm: GPT-2's LayerNorm, or DeepSeek-V3's RMSNorm (eps ``RMS_NORM_EPS``)."""
    if cfg.layout == DEEPSEEK_V3:
        return nn.RMSNorm(cfg.d_model, eps=RMS_NORM_EPS)
    return nn.LayerNorm(cfg.d_model, bias=cfg.bias)


RESIDUAL_PROJECTIONS = ("c_proj.weight", "down_proj.weight")
"""Weights that write into the residual stream (attention output, MLP output): initialised with std / √(2·n_layer)."""


class Block(nn.Module):
    """Pre-norm block: ``x + attn(ln_1 x)``, then ``x + mlp(ln_2 x)`` (the same names in both layouts)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = norm(cfg)
        self.attn = CausalSelfAttention(cfg) if cfg.attention == "mha" else MultiHeadLatentAttention(cfg)
        self.ln_2 = norm(cfg)
        self.mlp = MLP(cfg) if cfg.layout == GPT2 else SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cache: Optional[DecodeCache] = None, layer: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache=cache, layer=layer)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 decoder with MHA, MLA or MLA + KVSplice attention; with ``cfg.layout="deepseek_v3"`` the same three
    variants in DeepSeek-V3 blocks (RMSNorm, SwiGLU, RoPE; no ``wpe``; the head tied only with
    ``cfg.tie_embeddings``).

    ``model(idx)`` → logits ``(B, T, V)``; ``model(idx_chunk, cache=cache)`` appends the chunk (one token or
    several) to the cache and returns the chunk's logits.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        modules = dict(wte=nn.Embedding(cfg.vocab_size, cfg.d_model))
        if cfg.layout == GPT2:
            modules["wpe"] = nn.Embedding(cfg.block_size, cfg.d_model)  # learned positions; RoPE otherwise
        modules.update(drop=dropout(cfg.dropout), h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                       ln_f=norm(cfg))
        self.transformer = nn.ModuleDict(modules)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.reset_parameters()

    # ------------------------------------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), zero biases, residual projections scaled by 1/sqrt(2·n_layer).

        KVSplice modules are skipped and then get their own orthogonal init, so it is never overwritten.
        """
        splice_parts = {id(m) for s in self.modules() if isinstance(s, LearnedKVSplice) for m in s.modules()}
        for m in self.modules():
            if id(m) in splice_parts:
                continue
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                nn.init.ones_(m.weight)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        for name, p in self.named_parameters():
            if name.endswith(RESIDUAL_PROJECTIONS):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.cfg.n_layer))
        for m in self.modules():
            if isinstance(m, LearnedKVSplice):
                m.reset_parameters()

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        wpe = self.transformer["wpe"].weight.numel() if "wpe" in self.transformer else 0
        return n - wpe if non_embedding else n

    # ------------------------------------------------------------------------------------------------ forward
    def forward(self, idx: torch.Tensor, cache: Optional[DecodeCache] = None) -> torch.Tensor:
        b, t = idx.shape
        start = cache.position if cache is not None else 0  # absolute position of the first new token
        if start + t > self.cfg.block_size:
            raise ValueError(
                f"sequence of {start + t} tokens ({start} cached + {t} new) exceeds block_size="
                f"{self.cfg.block_size}; shorten the prompt/generation or use a model with a larger block_size")
        if cache is not None and cache.batch_size != b:
            raise ValueError(f"cache was built for batch size {cache.batch_size}, got a batch of {b}")
        if cache is not None and cache.dtype != self.transformer.wte.weight.dtype:
            raise ValueError(f"cache holds {cache.dtype} but the model computes in {self.transformer.wte.weight.dtype};"
                             f" build the cache with model.new_cache() after casting the model")
        x = self.transformer.wte(idx)  # (B, T, d_model); the deepseek_v3 layout's attention rotates by position
        if "wpe" in self.transformer:
            pos = cache.positions(t, idx.device) if cache is not None else torch.arange(t, device=idx.device)  # (T,)
            x = x + self.transformer.wpe(pos)
        x = self.transformer.drop(x)
        for i, block in enumerate(self.transformer.h):
            x = block(x, cache=cache, layer=i)
        return self.lm_head(self.transformer.ln_f(x))  # (B, T, V)

    # ------------------------------------------------------------------------------------------------ decode
    def new_cache(self, batch_size: int, capacity: Optional[int] = None, *, dtype: Optional[torch.dtype] = None,
                  device: Optional[Union[torch.device, str]] = None, quant: Any = ...) -> DecodeCache:
        """An empty decode cache for this model (dtype/device default to the model's).

        ``capacity`` preallocates that many tokens (exact bytes); without it the cache grows geometrically.
        ``quant``: ``None`` or ``"int8"`` (int8 rows + fp16 scales); default ``cfg.cache_quant``. The weights do not
        depend on it, so a trained model decodes with an int8 cache by passing ``quant="int8"``.
        """
        p = self.transformer.wte.weight
        quant = self.cfg.cache_quant if quant is ... else quant
        kw = dict(dtype=dtype or p.dtype, device=device or p.device, capacity=capacity, quant=quant)
        cfg = self.cfg
        if cfg.attention == "mha":
            return KVCache(cfg.n_layer, cfg.kv_heads, cfg.head_size, batch_size, **kw)
        if cfg.d_compressed is not None:  # rows [s | k_rope]: the latent, then the RoPE key (deepseek_v3 layout)
            return CompressedLatentCache(cfg.n_layer, cfg.cache_dim, batch_size, **kw)
        return LatentCache(cfg.n_layer, cfg.cache_dim, batch_size, **kw)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 cuda_graph: bool = False) -> torch.Tensor:
        """Prefill ``idx`` (B, T) into a fresh cache, then decode ``max_new_tokens`` one at a time from the cache
        (:func:`models.generate.generate_tokens`). ``temperature=0`` is greedy. Returns ``(B, T + max_new_tokens)``.
        ``cuda_graph=True`` (CUDA; int8 caches too) replays each decode step from a captured CUDA graph
        (:class:`models.graph_decode.GraphDecoder`): the same tokens, fewer kernel launches.
        """
        check_sampling(max_new_tokens, temperature, top_k)
        check_prompt(idx, self.cfg.vocab_size)
        b, t = idx.shape
        if t > self.cfg.block_size:
            raise ValueError(f"prompt of {t} tokens is longer than block_size={self.cfg.block_size}")
        if t + max_new_tokens > self.cfg.block_size:
            raise ValueError(f"prompt ({t}) + max_new_tokens ({max_new_tokens}) exceeds block_size="
                             f"{self.cfg.block_size}")
        cache = self.new_cache(b, capacity=t + max(max_new_tokens, 1) - 1)
        if not cuda_graph:
            return generate_tokens(lambda ids, c: self(ids, cache=c), cache, idx, max_new_tokens, temperature, top_k,
                                   generator)
        from models.graph_decode import GraphDecoder

        graphs: list[GraphDecoder] = []  # captured at the first decode step, after the prefill

        def step(ids: torch.Tensor, c: DecodeCache) -> torch.Tensor:
            if c.seq_len == 0:
                return self(ids, cache=c)  # prefill: eager (variable length)
            if not graphs:
                graphs.append(GraphDecoder(self, c))
            return graphs[0].step(ids)[:, None]  # (B, 1, V)

        return generate_tokens(step, cache, idx, max_new_tokens, temperature, top_k, generator)

    # ------------------------------------------------------------------------------------------- HF import
    @classmethod
    def from_hf(cls, source: Any, *, n_head: Optional[int] = None, **overrides) -> "GPT":
        """Import GPT-2 weights from ``transformers``: a ``GPT2LMHeadModel``, its ``state_dict()`` (pass ``n_head``),
        or a directory / hub id for ``GPT2LMHeadModel.from_pretrained``. ``overrides`` set other GPTConfig fields
        (e.g. ``attn_backend``)."""
        if isinstance(source, (str,)) or hasattr(source, "__fspath__"):
            from transformers import GPT2LMHeadModel

            source = GPT2LMHeadModel.from_pretrained(str(source))
        if isinstance(source, Mapping):
            sd = dict(source)
            if n_head is None:
                raise ValueError("from_hf(state_dict) needs n_head= (it cannot be read from the weights)")
            n_layer = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("transformer.h."))
            vocab, d_model = sd["transformer.wte.weight"].shape
            cfg = GPTConfig(vocab_size=vocab, n_layer=n_layer, n_head=n_head, d_model=d_model,
                            block_size=sd["transformer.wpe.weight"].shape[0], bias=True, attention="mha",
                            **overrides)
        else:
            hf = source.config
            if getattr(hf, "model_type", None) != "gpt2":
                raise ValueError(f"from_hf supports GPT-2 models, got model_type={getattr(hf, 'model_type', None)!r}")
            if hf.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
                raise ValueError(f"unsupported GPT-2 activation {hf.activation_function!r} (expected gelu_new)")
            if abs(hf.layer_norm_epsilon - 1e-5) > 1e-12:
                raise ValueError(f"unsupported layer_norm_epsilon {hf.layer_norm_epsilon} (expected 1e-5)")
            cfg = GPTConfig(vocab_size=hf.vocab_size, n_layer=hf.n_layer, n_head=hf.n_head, d_model=hf.n_embd,
                            block_size=hf.n_positions, bias=True, attention="mha", **overrides)
            sd = source.state_dict()
        model = cls(cfg)
        model.load_state_dict(_hf_gpt2_to_ours(sd, model.state_dict()))
        return model


HF_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
"""Weights HF GPT-2 stores as ``Conv1D`` (in, out): transposed against our ``nn.Linear`` (out, in)."""


def _hf_gpt2_to_ours(sd: Mapping[str, torch.Tensor], ours: Mapping[str, torch.Tensor]) -> dict:
    """Map an HF GPT-2 state dict onto ours: same names, Conv1D weights transposed, buffers dropped."""
    out = {}
    for name, target in ours.items():
        src = name
        if name == "lm_head.weight":
            src = "lm_head.weight" if "lm_head.weight" in sd else "transformer.wte.weight"
        if src not in sd:
            raise KeyError(f"HF GPT-2 state dict has no {src!r}")
        w = sd[src]
        if name.endswith(HF_CONV1D):
            w = w.t()
        if tuple(w.shape) != tuple(target.shape):
            raise ValueError(f"{name}: HF shape {tuple(w.shape)} does not match {tuple(target.shape)}")
        out[name] = w.detach().clone()
    return out

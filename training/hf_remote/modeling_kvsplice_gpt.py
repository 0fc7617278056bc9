"""An exported kvsplice GPT for transformers (remote code, self-contained: ``torch`` + ``transformers`` only).

``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` gives :class:`KVSpliceGPTForCausalLM`, the
package's ``models.GPT`` with the same module names and weights: GPT-2 blocks (learned positions, pre-LayerNorm,
GELU-tanh MLP) whose attention is

* ``mha``: multi-head or grouped-query attention; the cache holds K and V ``(B, n_kv_head, T, head_size)``;
* ``mla``: DeepSeek-style latent attention, ``c = w_dkv x`` (RMS-normalised with ``latent_norm``), with KVSplice
  ``s = C c``; the cache holds only the latent ``(B, T, d_latent)`` or ``s`` ``(B, T, d_compressed)``. With a
  cache (``generate()``) attention runs absorbed in latent space: ``q̃_h = (w_uk[h] E)ᵀ q_h``, scores against the
  cached latents, ``o_h = w_uv[h] E (Σ_t p_t s_t) + b_uv[h]`` — cached latents are never expanded to K/V. Without a
  cache (``use_cache=False``) it runs the naive path (expand to K/V), as the package's full forward does.

``generate()`` builds a :class:`KVSpliceGPTCache` (a ``transformers.Cache``) by itself; ``cache.nbytes()`` is the
bytes of what it holds: ``n_layer · cache_dim · T · B · bytes``. Attention masks (left padding) and
``position_ids`` (generate's cumsum numbering) are honoured; beam search reorders the cache.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

try:  # imported as part of the exported directory's remote-code package
    from .configuration_kvsplice_gpt import KVSpliceGPTConfig
except ImportError:  # imported as a plain module (tests, the package's templates)
    from configuration_kvsplice_gpt import KVSpliceGPTConfig


# --------------------------------------------------------------------------------------------------- cache
class _CacheLayer(CacheLayerMixin):
    """One layer's cached tensors, each ``(B, *lead, T, D)``, grown along dim -2."""

    is_compileable = False
    is_sliding = False

    def __init__(self):
        super().__init__()
        self.states = None

    def lazy_initialization(self, key_states, value_states):
        self.is_initialized = True

    def update(self, *new, **kwargs):
        self.is_initialized = True
        self.states = new if self.states is None else tuple(torch.cat([s, n], dim=-2) for s, n in zip(self.states, new))
        return self.states

    def get_seq_length(self):
        return 0 if self.states is None else self.states[0].shape[-2]

    def get_mask_sizes(self, query_length):  # transformers 4.56 – 5.2 pass cache_position
        q = query_length.shape[0] if isinstance(query_length, torch.Tensor) else query_length
        return self.get_seq_length() + q, 0

    def get_max_length(self):
        return -1

    get_max_cache_shape = get_max_length  # its name in transformers 4.56 – 5.2

    def reset(self):
        self.states = None

    def reorder_cache(self, beam_idx):
        if self.states is not None:
            self.states = tuple(s.index_select(0, beam_idx.to(s.device)) for s in self.states)

    def batch_repeat_interleave(self, repeats):
        if self.states is not None:
            self.states = tuple(s.repeat_interleave(repeats, dim=0) for s in self.states)

    def batch_select_indices(self, indices):
        if self.states is not None:
            self.states = tuple(s[indices] for s in self.states)

    def crop(self, tokens_to_remove):
        if self.states is not None and tokens_to_remove:
            self.states = tuple(s[..., :-abs(tokens_to_remove), :] for s in self.states)


class KVSpliceGPTCache(Cache):
    """Per layer: ``(k, v)`` ``(B, n_kv_head, T, head_size)`` for MHA, ``(latent,)`` ``(B, T, cache_dim)`` for MLA."""

    def __init__(self, n_layer):
        super().__init__(layers=[_CacheLayer() for _ in range(n_layer)])

    def append(self, layer, *new):
        return self.layers[layer].update(*new)

    def tensors(self):
        for layer in self.layers:
            if layer.states is not None:
                yield from layer.states

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self.tensors())


# ------------------------------------------------------------------------------------------------- modules
def _attention_mask(mask_2d, t_q, t_k, device):
    """Boolean ``(B or 1, 1, Tq, Tk)`` (True = attend): causal aligned bottom-right (query ``i`` at position
    ``Tk - Tq + i``) and, with ``mask_2d (B, Tk)``, no padding keys; every query sees at least itself (padding
    queries' outputs are unused, but must not be NaN). ``None`` for one query without padding."""
    if mask_2d is None and t_q == 1:
        return None
    q_pos = torch.arange(t_k - t_q, t_k, device=device)[:, None]  # (Tq, 1)
    k_pos = torch.arange(t_k, device=device)[None, :]  # (1, Tk)
    m = (k_pos <= q_pos)[None, None]  # (1, 1, Tq, Tk)
    if mask_2d is not None:
        m = (m & mask_2d[:, None, None, -t_k:].bool()) | (k_pos == q_pos)[None, None]  # (B, 1, Tq, Tk)
    return m


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class SelfAttention(nn.Module):
    """MHA / grouped-query attention; ``c_attn`` outputs ``[q (d_model) | k (Hkv·hs) | v (Hkv·hs)]``."""

    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head, self.hs = cfg.n_head, cfg.kv_heads, cfg.head_size
        self.c_attn = nn.Linear(cfg.d_model, cfg.d_model + 2 * self.n_kv_head * self.hs, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x, mask_2d, cache, layer):
        b, t, c = x.shape
        d_kv = self.n_kv_head * self.hs
        q, k, v = self.c_attn(x).split([c, d_kv, d_kv], dim=2)
        q = q.view(b, t, self.n_head, self.hs).transpose(1, 2)  # (B, H, T, hs)
        k, v = (z.view(b, t, self.n_kv_head, self.hs).transpose(1, 2) for z in (k, v))  # (B, Hkv, T, hs)
        if cache is not None:
            k, v = cache.append(layer, k, v)  # (B, Hkv, Tk, hs)
        m = _attention_mask(mask_2d, t, k.shape[2], x.device)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=1.0 / math.sqrt(self.hs),
                                           enable_gqa=self.n_kv_head != self.n_head)  # (B, H, T, hs)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))  # (B, T, d_model)


class KVSplice(nn.Module):
    """``compress`` (d_latent → d_compressed) and ``expand`` (d_compressed → d_latent), no biases."""

    def __init__(self, d_latent, d_compressed):
        super().__init__()
        self.compress = nn.Linear(d_latent, d_compressed, bias=False)
        self.expand = nn.Linear(d_compressed, d_latent, bias=False)


class LatentAttention(nn.Module):
    """MLA (+ KVSplice, + latent RMSNorm); see the module docstring for the absorbed cached path."""

    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.hs = cfg.n_head, cfg.head_size
        self.w_q = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.w_dkv = nn.Linear(cfg.d_model, cfg.d_latent, bias=cfg.bias)
        self.w_uk = nn.Linear(cfg.d_latent, cfg.d_model, bias=cfg.bias)
        self.w_uv = nn.Linear(cfg.d_latent, cfg.d_model, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.kv_norm = nn.RMSNorm(cfg.d_latent, eps=cfg.latent_norm_eps) if cfg.latent_norm else None
        self.splice = KVSplice(cfg.d_latent, cfg.d_compressed) if cfg.d_compressed is not None else None

    def forward(self, x, mask_2d, cache, layer):
        b, t, d = x.shape
        h, hs = self.n_head, self.hs
        q = self.w_q(x).view(b, t, h, hs).transpose(1, 2)  # (B, H, T, hs)
        c = self.w_dkv(x)  # (B, T, d_latent)
        if self.kv_norm is not None:
            c = self.kv_norm(c)
        scale = 1.0 / math.sqrt(hs)
        if cache is None:  # naive: expand every latent into K/V (the package's full forward)
            if self.splice is not None:
                c = self.splice.expand(self.splice.compress(c))
            k = self.w_uk(c).view(b, t, h, hs).transpose(1, 2)  # (B, H, T, hs)
            v = self.w_uv(c).view(b, t, h, hs).transpose(1, 2)  # (B, H, T, hs)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=_attention_mask(mask_2d, t, t, x.device),
                                               scale=scale)  # (B, H, T, hs)
        else:  # absorbed: attend over the cached (compressed) latents
            s = self.splice.compress(c) if self.splice is not None else c  # (B, T, r)
            (S,) = cache.append(layer, s)  # (B, Tk, r)
            q_lat = torch.einsum("bhtd,hdl->bhtl", q, self.w_uk.weight.view(h, hs, -1))  # (B, H, T, d_latent)
            if self.splice is not None:
                q_lat = q_lat @ self.splice.expand.weight  # (B, H, T, r)
            m = _attention_mask(mask_2d, t, S.shape[1], x.device)
            z = F.scaled_dot_product_attention(q_lat, S[:, None], S[:, None], attn_mask=m, scale=scale,
                                               enable_gqa=True)  # (B, H, T, r): Σ_t p_t s_t
            if self.splice is not None:
                z = z @ self.splice.expand.weight.T  # (B, H, T, d_latent)
            y = torch.einsum("bhtl,hdl->bhtd", z, self.w_uv.weight.view(h, hs, -1))  # (B, H, T, hs)
            if self.w_uv.bias is not None:
                y = y + self.w_uv.bias.view(1, h, 1, hs)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))  # (B, T, d_model)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.attn = SelfAttention(cfg) if cfg.attention == "mha" else LatentAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x, mask_2d, cache, layer):
        x = x + self.attn(self.ln_1(x), mask_2d, cache, layer)
        return x + self.mlp(self.ln_2(x))


# -------------------------------------------------------------------------------------------------- models
class KVSpliceGPTPreTrainedModel(PreTrainedModel):
    config_class = KVSpliceGPTConfig
    base_model_prefix = "transformer"
    _supports_sdpa = True

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


class KVSpliceGPTForCausalLM(KVSpliceGPTPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.d_model),
            wpe=nn.Embedding(config.block_size, config.d_model),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # generate() leaves the cache to forward(), which builds a KVSpliceGPTCache

    def get_input_embeddings(self):
        return self.transformer.wte

    def set_input_embeddings(self, value):
        self.transformer.wte = value

    def new_cache(self):
        return KVSpliceGPTCache(self.config.n_layer)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, labels=None, return_dict=True, **kwargs):
        b, t = input_ids.shape
        use_cache = self.config.use_cache if use_cache is None else use_cache
        cache = past_key_values
        if cache is not None and not isinstance(cache, KVSpliceGPTCache):
            if cache.get_seq_length() != 0:
                raise ValueError(f"{type(self).__name__} caches in its own KVSpliceGPTCache, got a filled "
                                 f"{type(cache).__name__}")
            cache = None
        if cache is None and use_cache:
            cache = self.new_cache()
        past = cache.get_seq_length() if cache is not None else 0
        if past + t > self.config.block_size:
            raise ValueError(f"sequence of {past + t} tokens exceeds block_size={self.config.block_size}")
        if position_ids is None and attention_mask is not None:  # left padding: real tokens count from 0
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -t:]  # (B, T)
        elif position_ids is None:
            position_ids = torch.arange(past, past + t, device=input_ids.device)[None]  # (1, T)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(position_ids)  # (B, T, d_model)
        for i, block in enumerate(self.transformer.h):
            x = block(x, attention_mask, cache, i)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)

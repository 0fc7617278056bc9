"""Attention: the kernel choice (flash-attn / SDPA), the causal attention math (written once), MHA (MLA:
:mod:`models.latent_attention`).

``attend`` is the only place where scores are formed; every module and every cache path calls it. It takes the
grouped-query layout ``q (B, Hq, Tq, D)``, ``k (B, Hkv, Tk, D)``, ``v (B, Hkv, Tk, Dv)`` with ``Hq % Hkv == 0``, and
aligns the causal mask bottom-right: with ``Tq`` new queries over ``Tk`` keys (cached + new), query ``i`` sits at
absolute position ``Tk - Tq + i``. (SDPA's ``is_causal=True`` aligns top-left, which is only right when
``Tq == Tk``: with one decode query it would see only key 0.)

MLA's absorbed path is the same call with ``Hkv = 1``: every query head attends over the one shared latent.
One-token cached steps may run the split-KV Triton kernel instead of SDPA (``backend="split_kv"``,
:mod:`models.kernels`; chosen once per module by ``cfg.decode_kernel``): the same math, one program per group of
heads that share a row stream, the keys split across the GPU, int8 rows read as they are stored.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from models.cache import Cache
from models.kernels import decode_attend, resolve_decode_kernel, use_decode_kernel
from models.rope import Rotary
from models.config import DEEPSEEK_V3, GPTConfig
from models.quant import SCALE
from models.stream_cache import DecodeCache

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


def positions(cache: Optional[Cache], t: int, device: torch.device) -> torch.Tensor:
    """Absolute positions ``(t,)`` of ``t`` new tokens: after what ``cache`` has seen, else from 0."""
    return cache.positions(t, device) if cache is not None else torch.arange(t, device=device)


# ------------------------------------------------------------------------------------------ kernel selection
@dataclass(frozen=True)
class FlashImpl:
    """An installed FlashAttention: ``name`` (``"flash-attn-2"`` or ``"flash-attn-4"``), its ``flash_attn_func`` and
    the lowest CUDA compute capability it runs on (FlashAttention-4 is written for Hopper and Blackwell)."""

    name: str
    fn: Callable
    min_capability: tuple[int, int]
    returns_lse: bool  # FlashAttention-4's flash_attn_func returns (out, lse)


@lru_cache(maxsize=1)
def flash_impl() -> Optional[FlashImpl]:
    """The FlashAttention the ``flash`` extra installed: flash-attn 2 (``flash_attn.flash_attn_func``) if importable,
    else FlashAttention-4 (``flash-attn-4``: ``flash_attn.cute.flash_attn_func``), else None. Resolved once per
    process; modules read it at construction, never inside ``forward`` (so ``torch.compile`` traces no import)."""
    try:
        from flash_attn import flash_attn_func  # type: ignore[import-not-found]

        return FlashImpl("flash-attn-2", flash_attn_func, (8, 0), returns_lse=False)
    except Exception:  # ImportError, or a broken CUDA build
        pass
    try:
        from flash_attn.cute import flash_attn_func  # type: ignore[import-not-found]

        return FlashImpl("flash-attn-4", flash_attn_func, (9, 0), returns_lse=True)
    except Exception:
        return None


def flash_unsupported_reason(device: torch.device, dtype: torch.dtype, head_dim: int, dv: Optional[int] = None,
                             *, installed: Optional[bool] = None,
                             impl: Optional[FlashImpl] = None) -> Optional[str]:
    """Why flash-attn cannot run this call, or None when it can. ``installed`` overrides the import check (tests);
    ``impl`` is the FlashAttention to judge (default: :func:`flash_impl`)."""
    if installed is None:
        impl = impl if impl is not None else flash_impl()
        installed = impl is not None
    if not installed:
        return ("flash-attn is not installed (pip install -e '.[flash]' on a CUDA machine: flash-attn 2, or "
                "'.[flash4]' for FlashAttention-4 on Hopper/Blackwell)")
    if device.type != "cuda":
        return f"flash-attn needs a CUDA device, got {device.type}"
    if dtype not in FLASH_DTYPES:
        return f"flash-attn needs fp16 or bf16, got {dtype}"
    if dv is not None and dv != head_dim:
        return f"flash-attn needs equal q/k and v head dims, got {head_dim} and {dv}"
    if head_dim % 8 != 0 or head_dim > FLASH_MAX_HEAD_DIM:
        return f"flash-attn needs a head dim that is a multiple of 8 and <= {FLASH_MAX_HEAD_DIM}, got {head_dim}"
    if impl is not None and not gpu_supports(impl, device):
        need = ".".join(map(str, impl.min_capability))
        cap = torch.cuda.get_device_capability(device)
        return f"{impl.name} needs compute capability >= {need}, got {cap[0]}.{cap[1]}"
    return None


def gpu_supports(impl: FlashImpl, device: Optional[torch.device] = None) -> bool:
    """Whether ``impl`` runs on ``device`` (default: the current CUDA device); False without CUDA."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= impl.min_capability


def select_backend(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                   dv: Optional[int] = None, *, installed: Optional[bool] = None,
                   impl: Optional[FlashImpl] = None) -> str:
    """``"flash"`` or ``"sdpa"`` for this call. ``"auto"`` prefers flash where it can run; ``"flash"`` raises a
    ``RuntimeError`` saying why when it cannot (never a silent fallback); ``"sdpa"`` always gives SDPA."""
    if requested == "sdpa":
        return "sdpa"
    reason = flash_unsupported_reason(device, dtype, head_dim, dv, installed=installed, impl=impl)
    if requested == "flash":
        if reason is not None:
            raise RuntimeError(f"attn_backend='flash' cannot run here: {reason}; use attn_backend='auto' or 'sdpa'")
        return "flash"
    if requested == "auto":
        return "sdpa" if reason is not None else "flash"
    raise ValueError(f"attn_backend must be one of ('auto', 'flash', 'sdpa'), got {requested!r}")


# SDPA's own kernel choice on CUDA. Left to itself, PyTorch may pick a kernel that plans per shape (cuDNN): a decode
# step attends over one more key than the last, so every step pays a new plan (40-64 ms per call seen on an H100 with
# torch 2.11, against 0.04-0.15 ms for a named kernel). Calls whose shapes repeat — the full forward of training, a
# CUDA-graph step — keep a planning kernel's advantage: unmasked ones are left to torch's default choice (what plain
# PyTorch code such as nanoGPT runs), masked ones prefer cuDNN. The order below is fixed instead: FlashAttention
# for long key sequences, the memory-efficient kernel for short ones (one query over few keys: its lower launch cost
# wins) and wherever a mask or bias is given (flash takes none), math last. Measured per GPU by
# ``benchmarks/gpu.py`` (``sdpa`` section); DECODE_FLASH_MIN_KEYS is the crossover seen on an H100.
DECODE_FLASH_MIN_KEYS = 2048
_LONG_ORDER = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
               SDPBackend.MATH)
_SHORT_ORDER = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                SDPBackend.MATH)


_FIXED_MASKED_ORDER = (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION,
                       SDPBackend.MATH)


def sdpa_order(t_q: int, t_k: int, fixed_masked: bool = False) -> tuple[SDPBackend, ...]:
    """SDPA kernel priority on CUDA for ``t_q`` queries over ``t_k`` keys (see :data:`DECODE_FLASH_MIN_KEYS`).
    ``fixed_masked``: a masked call whose shapes never change (a CUDA-graph step over a fixed-capacity cache): cuDNN,
    which takes the mask at flash-like speed and plans once per shape, then the memory-efficient kernel."""
    if fixed_masked:
        return _FIXED_MASKED_ORDER
    return _SHORT_ORDER if t_q * 8 <= t_k < DECODE_FLASH_MIN_KEYS else _LONG_ORDER


@contextmanager
def _sdpa_priority(order: tuple[SDPBackend, ...]) -> Iterator[None]:
    """Run SDPA with ``order`` as its kernel priority (every kernel stays enabled). Eager: two C calls (~1 µs;
    ``torch.nn.attention.sdpa_kernel`` costs ~60 µs a call, too much for a decode step of many layers); under
    ``torch.compile`` the public ``sdpa_kernel``, which dynamo traces."""
    if torch.compiler.is_compiling():
        with sdpa_kernel(list(order), set_priority=True):
            yield
        return
    previous = torch._C._get_sdp_priority_order()
    first = [int(b) for b in order]
    torch._C._set_sdp_priority_order(first + [b for b in previous if b not in first])
    try:
        yield
    finally:
        torch._C._set_sdp_priority_order(previous)


def dropout(p: float) -> nn.Module:
    """``nn.Dropout(p)``, or ``nn.Identity`` for ``p == 0``: a zero-rate dropout still launches a kernel (and its
    mask) per call in training mode, 25 times per forward in a 12-layer model, for nothing."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


# -------------------------------------------------------------------------------------------- the math, once
FUSED_HEAD_MULTIPLE = 8
"""Head sizes SDPA's fused CUDA kernels take are multiples of this; :func:`sdpa` pads others up to one."""


def causal_mask(t_q: int, t_k: int, device: torch.device, window: Optional[int] = None) -> torch.Tensor:
    """Bottom-right aligned causal mask ``(Tq, Tk)``: True where query i (position Tk-Tq+i) may see key j; with a
    sliding ``window``, only the last ``window`` keys up to its own."""
    q_pos = torch.arange(t_k - t_q, t_k, device=device)[:, None]  # (Tq, 1)
    k_pos = torch.arange(t_k, device=device)[None, :]  # (1, Tk)
    allowed = k_pos <= q_pos  # (Tq, Tk)
    return allowed & (k_pos > q_pos - window) if window else allowed


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: Optional[torch.Tensor] = None,
         is_causal: bool = False, dropout_p: float = 0.0, fixed_shape: bool = False,
         pad_to: Optional[int] = None) -> torch.Tensor:
    """``softmax(q·kᵀ·scale + mask)·v`` on matching head layouts: ``F.scaled_dot_product_attention``, except when the
    key and value head sizes differ (low-rank pre-RoPE keys vs value coefficients), where SDPA falls back to its slow
    generic kernel and the same math in three ops is faster. ``mask``: boolean (True = attend) or additive; a query
    row that may see no key gets zeros, not NaN.

    ``pad_to`` (default :data:`FUSED_HEAD_MULTIPLE` on CUDA, none elsewhere): a shared head size that is not a
    multiple of it (a KVSplice latent of 26 or 77 dims) is zero-padded to one for the call and the output sliced
    back — zeros change no score and no output column, and the fused kernels (flash, cuDNN) take only multiples of 8;
    without them SDPA runs its memory-efficient kernel with one block per sequence, 15x slower over 16k keys."""
    d = q.shape[-1]
    if pad_to is None:
        pad_to = FUSED_HEAD_MULTIPLE if q.device.type == "cuda" else 1
    if d % pad_to and d == k.shape[-1] == v.shape[-1] and dropout_p == 0.0:
        extra = (0, pad_to - d % pad_to)
        y = sdpa(F.pad(q, extra), F.pad(k, extra), F.pad(v, extra), scale=scale, mask=mask, is_causal=is_causal,
                 fixed_shape=fixed_shape, pad_to=1)  # (..., Tq, d + pad)
        return y[..., :d]
    if q.shape[-1] == v.shape[-1] or dropout_p > 0.0:
        if q.device.type != "cuda":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=dropout_p,
                                                  scale=scale)
        if fixed_shape and mask is None:  # shapes that repeat (training): torch's own choice, as plain PyTorch
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=dropout_p,
                                                  scale=scale)
        with _sdpa_priority(sdpa_order(q.shape[-2], k.shape[-2], fixed_shape and mask is not None)):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=dropout_p,
                                                  scale=scale)
    s = (q @ k.transpose(-1, -2)) * scale  # (B, H, Tq, Tk)
    if is_causal:
        mask = causal_mask(q.shape[-2], k.shape[-2], q.device)  # (Tq, Tk)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    p = torch.softmax(s, dim=-1)
    if mask is not None:
        p = p.nan_to_num(0.0)
    return p @ v  # (B, H, Tq, Dv)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, backend: str = "sdpa",
           dropout_p: float = 0.0, bias: Optional[torch.Tensor] = None,
           flash: Optional[FlashImpl] = None, fixed_shape: bool = False, lengths: Optional[torch.Tensor] = None,
           k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
           window: Optional[int] = None) -> torch.Tensor:
    """Causal attention of ``Tq`` new queries over ``Tk >= Tq`` keys whose last ``Tq`` are the queries' own.

    q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv), Hq % Hkv == 0 → (B, Hq, Tq, Dv).
    Query head h reads key/value head ``h // (Hq // Hkv)`` (the grouped-query convention of HF ``repeat_kv``).
    ``bias`` (B or 1, Hkv or 1, Tk), optional, is added to every score of a key (per-token log-weights of a
    token-subset cache: ``softmax(q·kᵀ·scale + bias)``; ``-inf`` for the unwritten rows of a fixed-capacity cache);
    it needs the SDPA backend. ``flash``: the FlashAttention to run with ``backend="flash"`` (default
    :func:`flash_impl`). ``fixed_shape``: the call's shapes never change (a CUDA-graph step), which lets SDPA use a
    kernel that plans per shape (:func:`sdpa_order`).

    ``backend="split_kv"`` (``Tq = 1`` only): the split-KV kernel (:func:`models.kernels.decode_attend`), which
    also takes ``lengths (B|1,)`` (keys past ``lengths[b]`` are not read: a fixed-capacity view's length instead of
    its bias) and int8 ``k``/``v`` with per-row scales ``k_scale``/``v_scale (B, Hkv, Tk, 1)``.

    ``window``: a sliding window (each query sees its last ``window`` keys, its own included; SDPA only).
    """
    b, hq, t_q, d = q.shape
    hkv, t_k = k.shape[1], k.shape[2]
    if hq % hkv != 0 or t_k < t_q:
        raise ValueError(f"attend: bad shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}")
    if window and backend != "sdpa":
        raise ValueError(f"attend: a sliding window needs backend='sdpa', got {backend!r}")
    if backend == "split_kv":
        if t_q != 1 or dropout_p > 0.0:
            raise ValueError(f"attend: the split-KV kernel takes one query and no dropout, got Tq={t_q}")
        return decode_attend(q, k, v, scale=scale, bias=bias, lengths=lengths, k_scale=k_scale, v_scale=v_scale)
    if k.dtype == torch.int8 or lengths is not None:
        raise ValueError("attend: int8 rows and lengths need backend='split_kv'")
    if backend == "flash":
        if bias is not None:
            raise ValueError("attend: flash-attn takes no additive bias; use backend='sdpa'")
        impl = flash if flash is not None else flash_impl()
        # flash-attn >= 2.1 and FlashAttention-4 align the causal mask bottom-right and take Hkv | Hq natively.
        kw = {} if dropout_p == 0.0 else {"dropout_p": dropout_p}  # FlashAttention-4 has no dropout argument
        y = impl.fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # (B, T, H, D)
                    softmax_scale=scale, causal=True, **kw)
        if impl.returns_lse:
            y = y[0]
        return y.transpose(1, 2)  # (B, Hq, Tq, Dv)
    g = hq // hkv
    if (g > 1 and t_q == t_k > 1 and bias is None and not window and q.device.type == "cpu" and dropout_p == 0.0
            and d == v.shape[-1]):
        # Square causal GQA on the CPU: SDPA's flash kernel with its own grouping, 2x faster than the folded
        # rows below (which need an explicit mask and take the generic path).
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    if g > 1:
        # Fold the g query heads that share a KV head into the query-row axis: no copy of K/V.
        q = q.reshape(b, hkv, g * t_q, d)  # (B, Hkv, g*Tq, D), rows ordered (head in group, query)
    if bias is not None:
        if bias.dim() != 3 or bias.shape[0] not in (1, b) or bias.shape[1] not in (1, hkv) or bias.shape[2] != t_k:
            raise ValueError(f"attend: bias must be (B, Hkv, Tk) = {(b, hkv, t_k)} (or 1 for B / Hkv), got "
                             f"{tuple(bias.shape)}")
        mask, is_causal = bias.to(q.dtype)[:, :, None, :], False  # (B|1, Hkv|1, 1, Tk), broadcast over query rows
        if t_q > 1 or window:
            allowed = causal_mask(t_q, t_k, q.device, window).repeat(g, 1)  # (g*Tq, Tk)
            mask = mask.masked_fill(~allowed, float("-inf"))  # (B|1, Hkv|1, g*Tq, Tk)
    elif window:
        mask, is_causal = causal_mask(t_q, t_k, q.device, window).repeat(g, 1), False  # (g*Tq, Tk)
    elif t_q == 1:
        mask, is_causal = None, False  # one new query sees every key
    elif t_q == t_k and g == 1:
        mask, is_causal = None, True  # square: SDPA's top-left alignment is right
    else:
        mask, is_causal = causal_mask(t_q, t_k, q.device).repeat(g, 1), False  # (g*Tq, Tk)
    y = sdpa(q, k, v, mask=mask, is_causal=is_causal, dropout_p=dropout_p, scale=scale,
             fixed_shape=fixed_shape)  # (B, Hkv, g*Tq, Dv)
    return y.reshape(b, hq, t_q, v.shape[-1])  # (B, Hq, Tq, Dv)


class _Attention(nn.Module):
    """What MHA and MLA share: config, output projection, dropout and the kernel choice for each call.

    Which FlashAttention is installed is resolved here, at construction: ``forward`` only compares the call's
    device, dtype and head sizes with it (plain Python that ``torch.compile`` traces without a graph break)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_head = cfg.n_head
        self.head_size = cfg.head_size
        self.scale = 1.0 / math.sqrt(cfg.head_size)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_dropout = dropout(cfg.dropout)
        impl = flash_impl() if cfg.attn_backend != "sdpa" else None
        # an installed FlashAttention this machine's GPU cannot run (FlashAttention-4 before Hopper) counts as absent
        self.flash = impl if impl is not None and (not torch.cuda.is_available() or gpu_supports(impl)) else None
        self.decode_kernel = resolve_decode_kernel(cfg.decode_kernel)  # once: may one-token steps run the kernel
        self.last_backend: Optional[str] = None  # which kernel the last call ran ("flash", "sdpa" or "split_kv")

    def _kernel(self, q: torch.Tensor) -> bool:
        """This call runs the split-KV kernel (one query; see :func:`models.kernels.use_decode_kernel`)."""
        return use_decode_kernel(self.decode_kernel, self.cfg.decode_kernel, q) and not (
            self.training and self.cfg.dropout > 0)

    def _append(self, q: torch.Tensor, cache: Cache, layer: int, **new: torch.Tensor
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Append the new rows; return the layer's rows per stream and, when the kernel reads an int8 cache as
        stored, their fp16 scales (else ``{}``: the rows arrive dequantised)."""
        if cache.quant is not None and self._kernel(q):
            rows = cache.append_rows(layer, **new)
            return {n: rows[n] for n in new}, {n: rows[n + SCALE] for n in new}
        return cache.append(layer, **new), {}

    def _attend(self, q, k, v, bias: Optional[torch.Tensor] = None, fixed_shape: bool = False,
                cache: Optional[Cache] = None, k_scale: Optional[torch.Tensor] = None,
                v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self._kernel(q):  # one-token step: the split-KV kernel; a fixed-capacity view's length replaces its bias
            lengths = cache.key_lengths() if cache is not None else None
            if not torch.compiler.is_compiling():
                self.last_backend = "split_kv"
            return attend(q, k, v, scale=self.scale, backend="split_kv", bias=None if lengths is not None else bias,
                          lengths=lengths, k_scale=k_scale, v_scale=v_scale)
        if bias is not None:  # a per-key bias (fixed-capacity cache): SDPA only
            backend = "sdpa"
        else:
            backend = select_backend(self.cfg.attn_backend, q.device, q.dtype, q.shape[-1], v.shape[-1],
                                     installed=self.flash is not None)
        if not torch.compiler.is_compiling():
            self.last_backend = backend
        return attend(q, k, v, scale=self.scale, backend=backend, bias=bias, flash=self.flash,
                      dropout_p=self.cfg.dropout if self.training else 0.0, fixed_shape=fixed_shape)

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        b, h, t, hs = y.shape
        y = y.transpose(1, 2).reshape(b, t, h * hs)  # (B, T, d_model)
        return self.resid_dropout(self.c_proj(y))


class CausalSelfAttention(_Attention):
    """GPT-2 multi-head attention, or grouped-query / multi-query attention with ``cfg.n_kv_head`` KV heads; caches
    K and V ``(B, Hkv, T, hs)`` per layer. ``c_attn`` outputs ``[q (d_model) | k (Hkv·hs) | v (Hkv·hs)]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.n_kv_head = cfg.kv_heads
        self.c_attn = nn.Linear(cfg.d_model, cfg.d_model + 2 * self.n_kv_head * cfg.head_size, bias=cfg.bias)
        # deepseek_v3 layout: Llama attention, RoPE over each whole head; the cache holds rotated keys
        self.rotary = Rotary(cfg.head_size, cfg.rope_theta) if cfg.layout == DEEPSEEK_V3 else None

    def forward(self, x: torch.Tensor, cache: Optional[DecodeCache] = None, layer: int = 0) -> torch.Tensor:
        b, t, c = x.shape
        d_kv = self.n_kv_head * self.head_size
        q, k, v = self.c_attn(x).split([c, d_kv, d_kv], dim=2)  # (B, T, d_model), 2 × (B, T, Hkv·hs)
        q = q.view(b, t, self.n_head, self.head_size).transpose(1, 2)  # (B, H, T, hs)
        k, v = (z.view(b, t, self.n_kv_head, self.head_size).transpose(1, 2) for z in (k, v))  # (B, Hkv, T, hs)
        if self.rotary is not None:
            pos = positions(cache, t, x.device)  # (T,)
            q, k = self.rotary(q, k, pos=pos)
        if cache is None:
            return self._out(self._attend(q, k, v, None, True))
        kv, sc = self._append(q, cache, layer, k=k, v=v)  # (B, Hkv, Tk, hs) each (int8 + scales (…, 1) for the kernel)
        bias = cache.key_bias()  # (1, 1, Tk) for a fixed-capacity view, else None
        return self._out(self._attend(q, kv["k"], kv["v"], bias, cache.fixed_shape, cache, sc.get("k"), sc.get("v")))

"""The HF door: :class:`KVSpliceHFCache`, a ``transformers.Cache`` that runs any compression method inside
transformers' own forward and ``generate()``.

::

    cache = KVSpliceHFCache(model, LowRank(bases))          # or DenseKV(cache_quant="int8"), TokenSelection(...), ...
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=32)
    cache.nbytes() == cache.formula_nbytes() == measure_cache(cache).live_bytes

The cache is built for one model (``LlamaForCausalLM`` with GQA + RoPE, or ``GPT2LMHeadModel``; see
:mod:`kvsplice.adapters`), binds the method to it (:meth:`~kvsplice.core.method.CompressionMethod.bind`) and
switches the model to the ``"kvsplice"`` attention implementation (:mod:`kvsplice.hf.attention`). The model's
attention modules project and rotate ``q, k, v`` as usual; ``update`` tags the new ``k, v`` and the ``"kvsplice"``
attention function hands them, with transformers' mask, to the method's
:meth:`~kvsplice.core.method.CompressionMethod.attend` — the same function the package's ``Decoder`` calls. This
door adds only transformers' bookkeeping (layers, sequence length, mask sizes) and the mask itself.

Its per-layer objects are ``transformers`` ``CacheLayerMixin`` layers that only forward to the cache; the numbers
live in the method's own cache (``method_cache``, built at the first ``update``, when batch size, dtype and device are
known), so bytes are measured from its tensors (:meth:`tensors`, :func:`kvsplice.report.memory.measure_cache`)
and compared with the method's formula.

``get_seq_length()`` is the number of tokens the sequences have *seen* (the next position), also for caches that
hold fewer (token selection): transformers derives positions and mask sizes from it. Beam search (reordering),
cropping (assisted decoding) and ``torch.compile`` are not supported and say so.

Sliding-window layers (Mistral, Qwen2/3, Phi-3, Gemma-3; :mod:`kvsplice.core.window`) are ``is_sliding`` layers
sized like transformers' own ``DynamicSlidingWindowLayer``: they hold their last tokens in order of position, so the
mask transformers builds over ``(held + new, offset = seen - held)`` is the window's over exactly what the method
holds; the layer runs the method's ``for_window`` variant and, once it attended, keeps its last ``window - 1`` tokens.

Works with transformers 4.56 – 5.23 (verified on 4.56.0, 4.57.6, 5.2.0, 5.23.0): ``get_mask_sizes`` takes the query
length (5.23) or ``cache_position`` (4.56 – 5.2); both ``get_max_length`` and ``get_max_cache_shape`` are answered.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from transformers.cache_utils import Cache as HFCache, CacheLayerMixin

from kvsplice.adapters.registry import adapter_for
from kvsplice.core.method import CompressionMethod, Step
from kvsplice.core.build import build_method
from kvsplice.core.rope import seen_by_any
from kvsplice.core.window import check_evictable, evict, held_per_layer
from kvsplice.hf.attention import ATTN_IMPL, tag, use_kvsplice_attention
from models.kernels import DEFAULT_DECODE_KERNEL, resolve_decode_kernel

__all__ = ["KVSpliceHFCache"]


class _Layer(CacheLayerMixin):
    """One layer's view of a :class:`KVSpliceHFCache` (transformers' per-layer interface)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "KVSpliceHFCache", layer: int, window: Optional[int]) -> None:
        super().__init__()
        self.owner, self.layer, self.window = owner, layer, window
        self.is_sliding = window is not None

    def lazy_initialization(self, key_states, value_states=None) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.is_initialized = True
        return self.owner.update_layer(self.layer, key_states, value_states)

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of transformers' mask: all tokens seen, or for a sliding-window layer the ones
        it holds (its last tokens). ``query_length``: an int, or ``cache_position`` (transformers 4.56 – 5.2)."""
        q = int(query_length.shape[0]) if isinstance(query_length, torch.Tensor) else int(query_length)
        seen = self.owner.get_seq_length()
        if not self.is_sliding or self.owner.method_cache is None:
            return seen + q, 0
        held = self.owner.method_cache.layer_len(self.layer)
        return held + q, seen - held

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # its name in transformers 4.56 – 5.2

    def reset(self) -> None:
        self.owner.reset()

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError(f"{type(self.owner).__name__} does not support beam search (num_beams > 1)")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(f"{type(self.owner).__name__} does not support cropping (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError(f"{type(self.owner).__name__}: pass one row per sequence "
                                      f"(num_return_sequences / beams > 1 are not supported)")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError(f"{type(self.owner).__name__} does not support selecting batch rows")


class KVSpliceHFCache(HFCache):
    """A ``transformers.Cache`` running ``method`` (any :class:`~kvsplice.core.method.CompressionMethod`, or its spec:
    ``"kivi4"``, :func:`kvsplice.build_method`) inside ``model``'s forward; see the module docstring. ``capacity``
    preallocates that many tokens (storage == live bytes); otherwise storage grows geometrically. ``decode_kernel``:
    one-token steps on the split-KV Triton kernel (``auto``: on CUDA with triton installed; ``triton``; ``eager``),
    as :class:`kvsplice.decode.Decoder`'s."""

    def __init__(self, model: torch.nn.Module, method: CompressionMethod | str | dict, *,
                 capacity: Optional[int] = None, decode_kernel: str = DEFAULT_DECODE_KERNEL) -> None:
        self.decode_kernel, self.kernel_on = decode_kernel, resolve_decode_kernel(decode_kernel)  # once
        self.adapter = adapter_for(model)
        if self.adapter.name == "gpt":
            raise ValueError("kvsplice HF caches run inside transformers models (LlamaForCausalLM, GPT2LMHeadModel); "
                             "models.GPT decodes with its own cache (model.new_cache / kvsplice.decode.Decoder)")
        if isinstance(method, (str, dict)):  # a spec: kvsplice.core.build
            method = build_method(method)
        if not isinstance(method, CompressionMethod):
            raise TypeError(f"method must be a kvsplice.core.CompressionMethod, got {type(method).__name__}")
        self.adapter.require_projections()
        p = self.adapter.param()
        self.method = method.bind(self.adapter, dtype=p.dtype, device=p.device)  # its checks: model, shapes
        self.windows = [self.adapter.window(l) for l in range(self.adapter.n_layer)]
        self.layer_methods = [self.method.for_window(w) if w else self.method for w in self.windows]
        super().__init__(layers=[_Layer(self, i, w) for i, w in enumerate(self.windows)])
        self.model = model
        self.capacity = capacity
        self.method_cache = None
        self.pads: Optional[torch.Tensor] = None  # (B,) left-padding columns, from the first call's mask
        self.scales = [self.adapter.scale(l) for l in range(self.adapter.n_layer)]  # refreshed by each call
        self.step: Optional[Step] = None
        use_kvsplice_attention(model)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        """Called by the ``"kvsplice"`` attention function with the new ``k, v (B, Hkv, Tq, D)`` that ``update``
        tagged: the method stores them and attends ``q (B, Hq, Tq, D)`` over its cache → ``(B, Hq, Tq, D)``."""
        self.scales[layer] = scale
        step = self.step
        if step.start == 0 and layer == 0 and mask is not None:  # the first call: padding is what no query sees
            self.pads = step.pads = (~seen_by_any(mask)).sum(-1)  # (B or 1,)
        y = self.layer_methods[layer].attend(layer, q, k, v, self.method_cache, step, mask=mask)
        w = self.windows[layer]
        if w is not None:
            evict(self.method_cache, layer, w - 1)  # the next token sees only the last w - 1 of them
        return y

    # ------------------------------------------------------------------------------------- transformers API
    def update_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        # once per forward call (every call passes layer 0 first): the config lookup is slow next to a decode step
        if layer == 0 and self.model.config._attn_implementation != ATTN_IMPL:
            raise RuntimeError(f"{type(self).__name__} needs the model's attention implementation {ATTN_IMPL!r} "
                               f"(it was changed to {self.model.config._attn_implementation!r} after the cache was built)")
        if self.method_cache is None:
            self.method_cache = self.method.new_cache(k.shape[0], self.capacity, dtype=k.dtype, device=k.device)
            check_evictable(self.method_cache, self.windows)
        elif self.method_cache.batch_size != k.shape[0]:
            raise ValueError(f"{type(self).__name__} holds {self.method_cache.batch_size} sequences, got a batch of "
                             f"{k.shape[0]}; build a new cache per generate() call")
        if layer == 0:  # a new forward call: its tokens start at the next position
            self.step = Step(self.adapter, self.method_cache.position, k.shape[2], self.scales, backend="sdpa",
                             pads=self.pads, decode_kernel=self.decode_kernel, kernel_on=self.kernel_on)
        return tag(k, self, layer), v

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.method_cache is None else self.method_cache.position

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return -1 if self.method_cache is None else self.method_cache.batch_size

    @property
    def is_compileable(self) -> bool:
        return False

    def reset(self) -> None:
        if self.method_cache is not None:
            self.method_cache.reset()
        self.pads = None

    def held(self):
        """Tokens the method's cache holds per layer as a method's ``bytes_formula`` takes them (a list when layers
        differ)."""
        return held_per_layer(self.method_cache) if any(self.windows) else self.method_cache.seq_len

    # ------------------------------------------------------------------------------------------------- bytes
    def formula_nbytes(self) -> Optional[int]:
        """The method's ``bytes_formula`` for the tokens held at its batch size and dtype (``None``: the
        method has no closed form) — equal to :meth:`nbytes`."""
        if self.method_cache is None:
            return 0
        s = self.method_cache
        return self.method.bytes_formula(s.batch_size, self.held(), s.dtype)

    def full_nbytes(self) -> int:
        """Bytes of the full K/V cache of the same tokens: ``2 · Hkv · head_dim · B · bytes`` per token held, summed
        over layers."""
        if self.method_cache is None:
            return 0
        a, s = self.adapter, self.method_cache
        held = self.held()
        tokens = held * a.n_layer if isinstance(held, int) else sum(held)
        return 2 * a.n_kv_head * a.head_dim * tokens * s.batch_size * torch.empty((), dtype=s.dtype).element_size()

    def tensors(self) -> Iterator[torch.Tensor]:
        """The live tensors the cache holds (for :func:`kvsplice.report.memory.measure_cache`)."""
        return iter(()) if self.method_cache is None else self.method_cache.tensors()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def seq_len(self) -> int:
        """Tokens held per layer (token selection holds fewer than it has seen)."""
        return 0 if self.method_cache is None else self.method_cache.seq_len

    def __repr__(self) -> str:
        return f"{type(self).__name__}(method_cache={self.method_cache!r})"

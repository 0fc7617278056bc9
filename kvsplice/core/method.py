"""The method core: one small class per way of caching and attending, called the same way by both doors.

A :class:`CompressionMethod` is bound to a model (:meth:`~CompressionMethod.bind` returns a prepared copy; the
method itself is never changed, so one instance serves any number of models), makes the cache
(:meth:`~CompressionMethod.new_cache`) and, per layer and forward call, **attends**:
:meth:`~CompressionMethod.attend` gets the layer's projected ``q (B, Hq, Tq, D)``, ``k, v (B, Hkv, Tq, D)`` —
queries **post-RoPE**, keys post-RoPE or pre-RoPE as the method declares (``key_rope``) and the door can give
(``step.k_rotated``) — stores what the method keeps of the new ``k, v`` in its cache and returns the head outputs
``(B, Hq, Tq, Dv)`` over the cache. It is the one function of the method; the two doors only call it:

* :class:`kvsplice.decode.Decoder` (the package's layer-wise decoder) projects ``q, k, v`` with the model's weights,
  rotates ``q`` and — unless the method keeps pre-RoPE keys — ``k``, calls ``attend`` and applies the output
  projection (:meth:`~CompressionMethod.block`);
* :class:`kvsplice.hf.KVSpliceHFCache` (a ``transformers.Cache`` + the ``"kvsplice"`` attention function) hands over
  what the model's own attention module computed — keys always rotated (``step.k_rotated``) — with transformers'
  ``mask``, and returns ``attend``'s output.

``mask`` is transformers' (boolean ``(B or 1, 1, Tq, Tk)`` over the absolute positions ``0 .. Tk-1`` of the tokens
seen, True = attend; ``None`` = causal without padding — from the ``Decoder`` only a sliding window's
(:func:`kvsplice.core.window.window_mask`), over the tokens the layer holds). ``logw``
``(B, Hkv, Tk)``, optional, are per-token log-weights added to the scores of the held tokens (a token subset
stored by another method: :class:`kvsplice.select.method.TokenSelection` with ``store=``). A method that keeps
pre-RoPE numbers (``key_rope = "pre"``) undoes the rotation of keys that arrive rotated itself
(:class:`kvsplice.core.rope.RopeTables`).

A **storage** method (one that can hold the tokens a selection keeps: ``DenseKV``, ``LowRank``) also implements
:meth:`~CompressionMethod.append` — store without attending — and accepts ``logw`` in ``attend``.

Sliding-window layers (:mod:`kvsplice.core.window`): both doors run :meth:`~CompressionMethod.for_window` of the
method on them, hand it a mask that hides what lies outside the window and evict the tokens that leave it; their
``bytes_formula`` gets the tokens held per layer.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from kvsplice.adapters.base import FamilyAdapter
from kvsplice.core.attention import dense_attend, kernel_attend
from kvsplice.core.registry import register, spec_of
from models.cache import Cache
from models.kernels import use_decode_kernel

__all__ = ["CompressionMethod", "Step", "layer_tokens"]


def layer_tokens(n_held: int | Sequence[int], n_layer: int) -> int:
    """Tokens held summed over layers: ``n_held · n_layer``, or the sum of a per-layer list."""
    if isinstance(n_held, int):
        return n_held * n_layer
    if len(n_held) != n_layer:
        raise ValueError(f"n_held has {len(n_held)} layers, the model has {n_layer}")
    return sum(int(n) for n in n_held)


@dataclass
class Step:
    """One forward call as every layer's ``attend`` sees it: ``t`` new tokens at absolute positions
    ``start .. start + t - 1``.

    ``scales[l]``: layer ``l``'s softmax scale; ``backend``: the dense attention kernel (``auto`` / ``flash`` /
    ``sdpa``); ``rope``: the RoPE tables of the new positions (the ``Decoder``'s, to rotate ``q, k``: what
    :meth:`~kvsplice.adapters.base.FamilyAdapter.rope` returns; ``None`` without RoPE or in the HF door);
    ``k_rotated``: the keys ``attend`` gets are rotated (always in the HF door; in the ``Decoder`` unless the
    method's ``key_rope`` is ``"pre"``); ``pads``: ``(B,)`` left-padding columns per sequence (HF door, from the first
    call's mask; ``None``: none) — with the tokens seen, the positions of held keys once a sliding window dropped
    some; ``memo``: what a method computes once per call and shares between layers (RoPE tables, the decode mask).
    ``decode_kernel`` / ``kernel_on``: the door's setting of the split-KV decode kernel and whether it resolved to
    run (:func:`models.kernels.resolve_decode_kernel`, once per door); :meth:`kernel` says whether a call takes it.
    """

    adapter: FamilyAdapter
    start: int
    t: int
    scales: list[float]
    backend: str = "auto"
    rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    k_rotated: bool = True
    pads: Optional[torch.Tensor] = None
    memo: dict[Any, Any] = field(default_factory=dict, repr=False)
    decode_kernel: str = "eager"
    kernel_on: bool = False

    def kernel(self, q: torch.Tensor) -> bool:
        """This one-query call runs the split-KV kernel (:meth:`decode_attend`) instead of the dense attention."""
        return use_decode_kernel(self.kernel_on, self.decode_kernel, q)

    def decode_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: Optional[torch.Tensor] = None, logw: Optional[torch.Tensor] = None, *,
                      scale: Optional[float] = None, k_scale: Optional[torch.Tensor] = None,
                      v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """:meth:`attend` of one query by the split-KV kernel (:func:`kvsplice.core.attention.kernel_attend`):
        ``k``/``v`` may be int8 rows with per-row scales; ``scale`` defaults to the layer's."""
        return kernel_attend(q, k, v, scale=self.scales[layer] if scale is None else scale, mask=mask, logw=logw,
                             k_scale=k_scale, v_scale=v_scale)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: Optional[torch.Tensor] = None, logw: Optional[torch.Tensor] = None) -> torch.Tensor:
        """:func:`kvsplice.core.attention.dense_attend` with the layer's scale and the call's kernel."""
        return dense_attend(q, k, v, scale=self.scales[layer], mask=mask, logw=logw, backend=self.backend)


class CompressionMethod:
    """One way of caching and attending (see the module docstring).

    Subclasses implement :meth:`new_cache` and :meth:`attend` (and :meth:`append` for a storage method); a method
    with settings to check against the model or operands to precompute overrides :meth:`_prepare`, which runs on
    the copy :meth:`bind` returns. ``needs_projections`` (default True): the method needs the layer's q/k/v/o
    projections (post-training methods; models whose cache is already a latent are refused). ``key_rope``:
    ``"pre"`` for a method that keeps keys in the un-rotated space (it needs their positions in its cache, so it
    cannot hold a reordered subset; the ``Decoder`` hands it un-rotated keys), else ``"post"``.
    ``is_storage``: the method implements :meth:`append` and ``logw`` (it can hold a token selection's subset).

    A subclass that sets ``name`` is registered under it (:mod:`kvsplice.core.registry`): ``build_method(spec)``
    builds it by name from its constructor arguments and :meth:`spec` gives them back. ``spec_files``: constructor
    arguments a spec may give as a file (read by :meth:`load_spec_file`); ``spec_nested``: arguments that are
    themselves a ``"method"`` or a ``"selector"`` (nested specs); ``spec_context``: arguments that come from the
    prompt being compressed, never from a spec (``"prompt_ids"``, ``"tokenizer"``: KVzip re-reads its prompt) —
    :func:`~kvsplice.core.build.build_method` passes them (``build_method(spec, prompt_ids=, tokenizer=)``);
    ``select_form``: a token selection that scores the prompt by a pass of its own, written
    ``select:NAME@AMOUNT[+STORE]`` in the short form like a selector.
    """

    name: str = "method"
    needs_projections: bool = True
    key_rope: str = "post"
    is_storage: bool = False
    cache_type: type = Cache
    adapter: Optional[FamilyAdapter] = None  # set on the bound copy
    spec_files: tuple[str, ...] = ()
    spec_nested: dict[str, str] = {}
    spec_context: tuple[str, ...] = ()
    select_form: bool = False

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        if "name" in cls.__dict__:
            register("method", cls)

    # -------------------------------------------------------------------------------------------------- spec
    def spec(self) -> dict[str, Any]:
        """The dict spec that rebuilds this method with :func:`kvsplice.build_method` (its name and the constructor
        arguments that differ from their defaults)."""
        return spec_of(self)

    @classmethod
    def load_spec_file(cls, arg: str, path: Any) -> Any:
        """The object a spec's file for the constructor argument ``arg`` (one of ``spec_files``) holds."""
        raise NotImplementedError(f"{cls.__name__} reads no files")

    # ------------------------------------------------------------------------------------------------ binding
    def bind(self, adapter: FamilyAdapter, *, dtype: torch.dtype, device: torch.device) -> "CompressionMethod":
        """A copy of this method prepared for ``adapter``'s model (checks, precomputed operands at ``dtype`` /
        ``device``); ``self`` is left unbound and unchanged."""
        bound = copy.copy(self)
        with torch.no_grad():
            bound._prepare(adapter, dtype=dtype, device=device)
        bound.adapter = adapter
        return bound

    def _prepare(self, adapter: FamilyAdapter, *, dtype: torch.dtype, device: torch.device) -> None:
        if self.needs_projections:
            adapter.require_projections()

    def _bound(self) -> FamilyAdapter:
        if self.adapter is None:
            raise RuntimeError(f"{type(self).__name__} is not bound to a model: use Decoder(model, method), "
                               f"KVSpliceHFCache(model, method) or method.bind(adapter, dtype=, device=)")
        return self.adapter

    # -------------------------------------------------------------------------------------------------- cache
    def new_cache(self, batch_size: int, capacity: Optional[int] = None, *, dtype: torch.dtype,
                  device: torch.device) -> Cache:
        """An empty cache for ``batch_size`` sequences (``capacity``: tokens held per layer, preallocated)."""
        raise NotImplementedError(f"{type(self).__name__} does not define new_cache")

    def check_cache(self, cache: Cache) -> None:
        """Raise ``TypeError`` for a cache this method cannot use."""
        if not isinstance(cache, self.cache_type):
            raise TypeError(f"{type(self).__name__} needs a {self.cache_type.__name__} from decoder.new_cache(), got "
                            f"{type(cache).__name__}")

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        """Tokens the cache holds at the end of ``generate`` (exact preallocation)."""
        return prompt_len + max(max_new_tokens, 1) - 1

    def bytes_formula(self, batch_size: int, n_held: int | Sequence[int], dtype: torch.dtype) -> Optional[int]:
        """Bytes the method's cache holds for ``n_held`` tokens per layer (or a list: the tokens each layer holds,
        for models with sliding-window layers) of ``batch_size`` sequences at ``dtype``; ``None`` for a method
        without a closed form (the online method's chunks)."""
        return None

    def for_window(self, window: int) -> "CompressionMethod":
        """The method for a layer that sees only its last ``window`` tokens (the doors evict the rest and mask what
        lies outside the window): ``self`` for methods that keep a layer's tokens in order; a token selection
        keeps the window's most recent tokens instead of a subset."""
        return self

    # ---------------------------------------------------------------------------------------------- attention
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: Cache, step: Step,
               mask: Optional[torch.Tensor] = None, logw: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Store the new ``k, v (B, Hkv, Tq, D)`` of ``layer`` in ``cache`` (keys rotated unless ``step.k_rotated``
        is False) and attend the post-RoPE ``q (B, Hq, Tq, D)`` over everything the layer holds →
        ``(B, Hq, Tq, Dv)``. See the module docstring for ``mask`` / ``logw``."""
        raise NotImplementedError(f"{type(self).__name__} does not define attend")

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, cache: Cache, step: Step) -> None:
        """Storage methods: store post-RoPE ``k, v (B, Hkv, T, D)`` without attending (the tokens a selection
        keeps, in any order per KV head)."""
        raise NotImplementedError(f"{type(self).__name__} is not a storage method (it cannot hold a token subset)")

    def block(self, layer: int, h: torch.Tensor, cache: Cache, step: Step,
              mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The ``Decoder``'s attention block for the normalised hidden states ``h (B, T, d_model)``: project ``q, k,
        v`` with the model's weights, rotate ``q`` (and ``k`` if ``step.k_rotated``), :meth:`attend` (``mask``: a
        sliding window's, else ``None``), output projection → ``(B, T, d_model)``."""
        a = step.adapter
        q, k, v = a.qkv(layer, h, step.rope, rotate_k=step.k_rotated)  # (B, Hq, T, D), (B, Hkv, T, D) × 2
        return a.out(layer, self.attend(layer, q, k, v, cache, step, mask=mask))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

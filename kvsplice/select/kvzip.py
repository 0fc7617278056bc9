"""KVzip-style, query-agnostic token selection (Kim et al. 2025): keep the context tokens the model needs to
*reconstruct* the context.

After the (exact) prefill of a layer, a second pass — the reconstruction prompt: ``repeat`` ("Repeat the previous
context exactly.") followed by the prompt itself, at the positions after it — runs through the same layer over the
layer's full cache; every prompt token is scored by the largest attention it receives from any reconstruction query of
any query head of its KV head, and each KV head keeps its ``budget`` highest-scored tokens (log-weight 0). The
reconstruction pass is carried layer to layer (its hidden states live in the call's ``step.memo``) with the model's
own weights through the family adapter, so it runs inside either door: the package's ``Decoder`` and transformers'
``generate()`` call the same ``attend``. The question is never needed: a cache compressed this way serves any later
question.

It re-reads its prompt, so it is built per prompt, from a spec like any method (``spec_context``)::

    build_method("select:kvzip@x4+int8", prompt_ids=ids, tokenizer=tok)      # ids (B or 1, P): the prompt prefilled
    KVzipSelection(budget=P // 4, prompt_ids=ids, tokenizer=tok, store=DenseKV(cache_quant="int8"))
    Plan.load("plan.json").method(prompt_ids=ids, tokenizer=tok)             # a plan that picked it

Cost: one more pass over the context (the reconstruction) at prefill; nothing at decode. Models with sliding-window
layers are refused (a window keeps its most recent tokens anyway).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from kvsplice.core.args import choice_arg, int_arg
from kvsplice.core.method import CompressionMethod
from kvsplice.decode.dense import DenseKV
from kvsplice.select.method import TokenSelection
from kvsplice.select.kvzip_local import LocalRepeat
from kvsplice.select.pooled import PooledSubsetCache, own_tokens, pool_tokens
from kvsplice.select.pooled_layers import PooledLayers
from kvsplice.select.scores import _top
from kvsplice.select.selectors import TokenSelector

__all__ = ["KVzipSelection", "REPEAT_PROMPT", "ReconstructionScores"]

REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"
"""The instruction before the context in the reconstruction pass."""

DECODED = ("store", "int8", "full")
"""How ``heads="pooled"`` holds the tokens decoded after the prompt: as its store holds the prompt's, as int8 rows
(keys and values; 8 bits where the store gives a value 4), or at the cache's precision."""

DEFAULT_SHARE = 0.5
"""The part of the budget ``mix=`` keeps when ``share=`` is not given (``share`` without ``mix`` is refused: it
would be dropped)."""

RECON = ("exact", "local")
"""How the reconstruction scores are formed: the instruction and the whole prompt re-read through every layer (KVzip's
pass), or the instruction alone re-read and the prompt's repeat stood in for by the prefill's own queries over the
keys around each copied token (:class:`~kvsplice.select.kvzip_local.LocalRepeat`: no second prefill)."""

HEADS = ("own", "union", "pooled")
"""How a layer's KV heads choose: each its own top tokens; all the tokens any of them ranks best; or the best
``Hkv · budget`` of all heads' scores together, a head keeping as many as it wins (:mod:`kvsplice.select.pooled`)."""


class ReconstructionScores(TokenSelector):
    """Keeps the ``budget`` tokens of the highest scores set by :class:`KVzipSelection` for the layer being
    compressed (``scores (B·Hkv, T)``); log-weights 0. With ``mix`` (another selector) and ``share``: the
    ``ceil(share · budget)`` tokens ``mix`` keeps come first, the rest by the reconstruction scores. With
    ``heads="union"`` every KV head of a layer keeps the same tokens: those whose best rank in any of the layer's
    ``n_kv_head`` heads (the rows of ``scores``, ``n_kv_head`` per sequence) is highest — a token one head needs is
    kept by all. Not registered with ``make_selector``: its scores come from the reconstruction pass."""

    def __init__(self, mix: Optional[TokenSelector] = None, share: float = 0.0, heads: str = "own",
                 seed: int = 0) -> None:
        super().__init__(seed)
        self.scores: Optional[torch.Tensor] = None
        self.n_kv_head = 1  # rows of ``scores`` per sequence (set with the scores)
        self.mix_votes: Optional[dict] = None  # {votes_key: (B·Hkv, T)} of this layer's context (set with the scores)
        self.mix, self.share, self.heads = mix, share, heads
        self.needs_queries = bool(mix is not None and mix.needs_queries)

    def ranked(self, k: torch.Tensor, v: torch.Tensor, budget: int, q: Optional[torch.Tensor] = None,
               scale: Optional[float] = None) -> torch.Tensor:
        """The scores the choice is made on, ``(B·Hkv, T)``: the reconstruction scores (one ranking per layer with
        ``heads="union"``), ``+inf`` on the ``ceil(share · budget)`` tokens the ``mix`` selector keeps per head."""
        if self.scores is None or self.scores.shape != k.shape[:2]:
            raise ValueError("kvzip scores come from the reconstruction pass: use KVzipSelection, not make_selector")
        scores = self.scores.to(k.device)
        if self.heads == "union":
            rank = scores.argsort(dim=-1).argsort(dim=-1).float()  # (B·Hkv, T): 0 = lowest score of its head
            best = rank.view(-1, self.n_kv_head, rank.shape[-1]).amax(dim=1, keepdim=True)  # (B, 1, T)
            scores = best.expand(-1, self.n_kv_head, -1).reshape(scores.shape)  # (B·Hkv, T): one ranking per layer
        n_mix = min(budget, math.ceil(self.share * budget - 1e-9)) if self.mix is not None else 0
        if n_mix:
            scores = scores.scatter(1, self._mixed(k, v, n_mix, q, scale), float("inf"))  # kept whatever their
            # reconstruction scores
        return scores

    def _mixed(self, k, v, n_mix: int, q, scale) -> torch.Tensor:
        """``(B·Hkv, n_mix)``: the mixed-in selector's own choice — from the context's kept votes where it has a
        :meth:`votes` (the same tokens its ``select`` keeps: the top of them), computing and keeping them once."""
        memo, key = self.mix_votes, getattr(self.mix, "votes_key", None)
        if memo is None or key is None or n_mix >= k.shape[1]:
            kw = {"q": q, "scale": scale} if self.mix.needs_queries else {}
            return self.mix.select(k, v, n_mix, **kw)[0]  # (H, n_mix)
        key = (key, k.dtype, tuple(k.shape), tuple(q.shape), scale)
        if key not in memo:
            memo[key] = self.mix.votes(k, q, scale)  # (B·Hkv, T)
        return _top(memo[key], n_mix)

    def _select(self, k, v, budget, q=None, scale=None):
        idx = _top(self.ranked(k, v, budget, q, scale), budget)
        return idx, torch.zeros(idx.shape, dtype=torch.float32, device=k.device)


class KVzipSelection(TokenSelection):
    """Keep ``budget`` prompt tokens per KV head, scored by the reconstruction pass over ``prompt_ids (B or 1, P)``
    (the prompt this method will prefill; ``tokenizer`` encodes ``repeat``); held by ``store`` (default full K/V).
    ``chunk``: reconstruction queries per score block. ``mix``: a selector spec (``"observed_attention"``) whose own
    choice of ``ceil(share · budget)`` tokens is kept first, the rest by the reconstruction scores (what the next
    words need beside what a later question needs); ``share`` (default :data:`DEFAULT_SHARE`) needs ``mix``. ``shared_scores``: a dict in which the scores of a finished
    pass over the same prompt are kept and reused (several budgets over one prefill; ``shared_votes`` the same for
    the ``mix`` selector's votes; both set by :meth:`share_context`). ``heads``: ``"own"`` — each KV
    head keeps its own top tokens —, ``"union"`` — every KV head keeps the tokens ranked best by any of them
    (:class:`ReconstructionScores`) — or ``"pooled"`` — a layer keeps the ``Hkv · budget`` best of all its heads'
    scores, each head as many as it wins (KVzip's non-uniform head budgets; the same bytes, held in a
    :class:`~kvsplice.select.pooled.PooledSubsetCache`; a dense store only: full precision, int8 or int4 rows,
    Hadamard-rotated or not); ``layers``: with ``"pooled"``, the layers that pool — a range (``"15-19"``) or a band
    of the depth in percent (``"50%-67%"``: the layers whose middles lie in that part of the depth, 15-19 of
    SmolLM2-135M's 30, 2 of 5: any model) —; the others keep each head's own ``budget`` tokens in the same cache
    (default: every layer pools); ``decoded``: with ``"pooled"``, how the tokens decoded after the prompt (a later
    question, the answer) are held — ``"store"`` as the prompt's (default), ``"int8"`` as int8 rows, ``"full"`` at
    the cache's precision (:data:`DECODED`; the prompt's bytes per token, what a plan's budget counts, are
    unchanged; each decoded token costs its own rows); ``recon``: ``"exact"`` (default: the reconstruction pass
    re-reads the whole prompt) or ``"local"`` (:data:`RECON`: only the instruction is re-read; the prefill's queries,
    moved to the repeat's positions, score the ``reach`` tokens either side of each —
    :class:`~kvsplice.select.kvzip_local.LocalRepeat`, a fraction of the exact pass's cost)."""

    name = "kvzip"
    select_form = True
    spec_nested = {"store": "method"}
    spec_context = ("prompt_ids", "tokenizer")

    def __init__(self, budget: int, *, store: Optional[CompressionMethod] = None, repeat: str = REPEAT_PROMPT,
                 chunk: int = 64, mix: Optional[str] = None, share: Optional[float] = None, heads: str = "own",
                 layers: Optional[int | str] = None, decoded: str = "store", recon: str = "exact", reach: int = 64,
                 prompt_ids: Optional[torch.Tensor] = None, tokenizer: Any = None) -> None:
        if mix is not None:
            from kvsplice.core.build import build_selector

            build_selector(mix)  # a known selector, checked now
        if share is not None and mix is None:
            raise ValueError(f"share={share!r} is the part of the budget mix= keeps: give mix= too (e.g. "
                             f"mix=observed_attention), or leave share out")
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not 0.0 <= share <= 1.0):
            raise ValueError(f"share must be a fraction in [0, 1], got {share!r}")
        self.mix, self.share, self.heads = mix, None if share is None else float(share), choice_arg("heads", heads,
                                                                                                   HEADS)
        self._share = DEFAULT_SHARE if share is None else float(share)  # with mix: its part of the budget
        self._layers = None if layers is None else PooledLayers.parse(layers)
        self.layers = None if self._layers is None else str(self._layers)
        if self.layers is not None and self.heads != "pooled":
            raise ValueError("layers= chooses the layers whose heads share one budget: it needs heads=pooled")
        self.decoded = choice_arg("decoded", decoded, DECODED)
        self.recon, self.reach = choice_arg("recon", recon, RECON), int_arg("reach", reach, 1)
        self._local = LocalRepeat(window=self.reach) if self.recon == "local" else None
        if self.decoded != "store" and self.heads != "pooled":
            raise ValueError("decoded= sets how heads=pooled holds the decoded tokens apart from the prompt's: it "
                             "needs heads=pooled")
        super().__init__(self._scorer(), budget, store=store)
        if not isinstance(repeat, str):
            raise ValueError(f"repeat must be the text of the reconstruction instruction, got {repeat!r}")
        if prompt_ids is not None and (not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2
                                       or prompt_ids.shape[1] < 1 or prompt_ids.is_floating_point()):
            raise ValueError("prompt_ids must be the prompt's token ids (B or 1, P) with P >= 1")
        self.repeat, self.chunk, self.prompt_ids = repeat, int_arg("chunk", chunk, 1), prompt_ids
        self.repeat_ids = None if tokenizer is None else _encode(tokenizer, repeat)
        self.shared_scores: Optional[dict] = None  # {layer: scores} of a finished pass over the same prompt
        self.shared_votes: Optional[dict] = None  # {layer: {key: votes}}: the mixed-in selector's, same prompt

    @property
    def shared_key(self) -> tuple:
        """Methods with equal keys compute the same scores for a prompt (they may share them: ``shared_scores``)."""
        return ("kvzip", self.repeat, self.recon, self.reach if self.recon == "local" else None)

    def share_context(self, context: dict) -> None:
        """Keep this prompt's per-context work in ``context`` (one dict per prompt, handed to every method built
        for it: :func:`~kvsplice.core.build.per_prompt`) and reuse what another method kept there: the
        reconstruction scores (under :attr:`shared_key`) and the ``mix`` selector's votes per layer."""
        self.shared_scores = context.setdefault(self.shared_key, {})
        self.shared_votes = context.setdefault("mix_votes", {})

    def _scorer(self) -> ReconstructionScores:
        from kvsplice.core.build import build_selector

        return ReconstructionScores(None if self.mix is None else build_selector(self.mix), self._share, self.heads)

    def _prepare(self, adapter, *, dtype, device):
        super()._prepare(adapter, dtype=dtype, device=device)
        if any(adapter.window(l) for l in range(adapter.n_layer)):
            raise ValueError("KVzipSelection does not support sliding-window layers")
        # (first, last) pooled layer of this model; None: every layer pools
        self._span = None if self._layers is None else self._layers.span(adapter.n_layer)
        if self.heads == "pooled" and not isinstance(self.store, DenseKV):
            raise ValueError(f"kvzip(heads=pooled) holds its tokens as rows of one pool per layer: its store must be "
                             f"dense (full precision, int8 or int4 rows), got {self.store!r}")
        # the rows of the decoded tokens: the store's, or a dense store of their own (in the store's frame)
        self.decoded_store = self.store if self.decoded == "store" else DenseKV(
            cache_quant="int8" if self.decoded == "int8" else None, rotate=self.store.rotate).bind(
            adapter, dtype=dtype, device=device)
        self.selector = self._scorer()  # the bound copy's own (scores are set per layer at prefill)
        self.layer_scores: dict[int, torch.Tensor] = {}  # the last prefill's scores (B, Hkv, T) per layer

    def compress_prefill(self, layer, q, k, v, cache, step, mask=None) -> None:
        """The reconstruction pass's scores of ``layer`` (or those of a finished pass over the same prompt), then
        the selection's prefill cache by them."""
        if self.prompt_ids is None or self.repeat_ids is None:
            raise ValueError("KVzip re-reads the prompt it compresses: build it per prompt with its ids and "
                             "tokenizer (build_method(spec, prompt_ids=ids, tokenizer=tok))")
        if self.prompt_ids.shape[1] != k.shape[2]:
            raise ValueError(f"this KVzip was built for a {self.prompt_ids.shape[1]}-token prompt; the prefill "
                             f"has {k.shape[2]} tokens: build it with the ids being prefilled")
        shared = self.shared_scores
        if shared is not None and len(shared) == self.adapter.n_layer and shared[layer].shape == (*k.shape[:2],
                                                                                                   k.shape[2]):
            self.layer_scores[layer] = shared[layer]  # the same context's pass, done once for every budget
        else:
            self.layer_scores[layer] = self._scores(layer, q, k, v, step)  # (B, Hkv, T)
            if shared is not None and layer == self.adapter.n_layer - 1:
                shared.update(self.layer_scores)
        self.selector.scores = self.layer_scores[layer].reshape(-1, k.shape[2])  # (B·Hkv, T)
        self.selector.n_kv_head = k.shape[1]
        self.selector.mix_votes = None if self.shared_votes is None else self.shared_votes.setdefault(layer, {})
        if self.heads != "pooled":
            return super().compress_prefill(layer, q, k, v, cache, step, mask=mask)
        b, h, t, d = k.shape
        n_keep = min(self.budget, t)
        qs = q.reshape(b * h, -1, d) if self.selector.needs_queries else None  # (B·Hkv, g·T, D): a KV head's queries
        scores = self.selector.ranked(k.reshape(b * h, t, d), v.reshape(b * h, t, -1), n_keep, q=qs,
                                      scale=step.scales[layer])  # (B·Hkv, T)
        kr, vr = self.store.rotated(k), self.store.rotated(v)  # the store's frame (a Hadamard-rotated store)
        pools = self._span is None or self._span[0] <= layer <= self._span[1]
        pick = pool_tokens if pools else own_tokens  # outside layers=: each head its own n_keep
        cache.fill(layer, kr, vr, pick(scores.view(b, h, t), n_keep))

    # ------------------------------------------------------------------------- heads="pooled": its own cache
    @property
    def n_keep(self) -> Optional[int]:
        """Prompt tokens kept per head: ``min(budget, P)`` for the prompt built with (``None`` before one is)."""
        return None if self.prompt_ids is None else min(self.budget, self.prompt_ids.shape[1])

    def new_cache(self, batch_size, capacity=None, *, dtype, device):
        if self.heads != "pooled":
            return super().new_cache(batch_size, capacity, dtype=dtype, device=device)
        a = self._bound()
        n_keep = self.n_keep
        recent = None if capacity is None or n_keep is None else max(capacity - n_keep, 0)  # decoded tokens
        return PooledSubsetCache(a.n_layer, a.n_kv_head, a.head_dim, batch_size, dtype=dtype, device=device,
                                 capacity=recent, quant=self.store.quant, decoded_quant=self.decoded_store.quant,
                                 pool_capacity=None if n_keep is None else a.n_kv_head * n_keep)

    def check_cache(self, cache):
        if self.heads != "pooled":
            return super().check_cache(cache)
        if not isinstance(cache, PooledSubsetCache):
            raise TypeError(f"kvzip(heads=pooled) needs a PooledSubsetCache from decoder.new_cache(), got "
                            f"{type(cache).__name__}")

    def bytes_formula(self, batch_size, n_held, dtype):
        """``heads="pooled"``: the dense store's bytes of the prompt's ``min(n_held, n_keep)`` tokens per head, the
        decoded store's of the rest (``decoded``) + each head's count (int32) per layer; else
        :meth:`TokenSelection.bytes_formula`."""
        if self.heads != "pooled":
            return super().bytes_formula(batch_size, n_held, dtype)
        a = self._bound()
        prompt = min(n_held, self.budget if self.n_keep is None else self.n_keep)
        return (self.store.bytes_formula(batch_size, prompt, dtype)
                + self.decoded_store.bytes_formula(batch_size, n_held - prompt, dtype)
                + a.n_layer * batch_size * a.n_kv_head * 4)

    def attend(self, layer, q, k, v, cache, step, mask=None, logw=None):
        if self.heads != "pooled" or cache.layer_len(layer) == 0:  # prefill: exact, then compress_prefill
            return super().attend(layer, q, k, v, cache, step, mask=mask, logw=logw)
        if logw is not None:
            raise ValueError("a token selection does not hold another selection's log-weights")
        r = self.store.rotated
        y = cache.attend(step, layer, r(q), r(k), r(v))  # (B, Hq, Tq, D): the pool (each head its own) + the decoded
        return self.store.unrotated(y)

    def _scores(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step) -> torch.Tensor:
        """The reconstruction pass through ``layer`` over the context's ``k, v (B, Hkv, T, D)`` (post-RoPE) →
        max attention per context token ``(B, Hkv, T)``; the pass's hidden states move on to the next layer. With
        ``recon="local"`` the pass holds the instruction alone and the prefill's queries ``q (B, Hq, T, D)`` stand
        in for the prompt's repeat (:class:`~kvsplice.select.kvzip_local.LocalRepeat`)."""
        if step.pads is not None and bool((step.pads > 0).any()):
            raise ValueError("KVzipSelection needs unpadded prompts (one sequence per call, or equal lengths)")
        a = self._bound()
        b, hkv, t, d = k.shape
        key = ("kvzip", id(self))
        x = step.memo.get(key)
        if layer == 0 or x is None:  # the pass starts: embed its ids once, later layers carry its hidden states
            prompt = self.prompt_ids.to(k.device).expand(b, -1)  # (B, P)
            rep = torch.tensor([self.repeat_ids], dtype=prompt.dtype, device=k.device).expand(b, -1)  # (B, R)
            ids = rep if self._local is not None else torch.cat([rep, prompt], dim=1)  # the ids the pass re-reads
            x = a.embed(ids, t)  # (B, Tr, d_model) at positions t .. t + Tr - 1
        tr = x.shape[1]
        rope = a.rope(x, t, tr, layer) if a.has_rope else None
        qr, kr, vr = a.qkv(layer, a.attn_in(layer, x), rope)  # (B, Hq, Tr, D), (B, Hkv, Tr, D) × 2
        scores = torch.zeros(b, hkv, t, dtype=torch.float32, device=k.device)
        last = layer == a.n_layer - 1  # the pass ends here: its output is not needed
        y = self._pass(qr, k, v, kr, vr, step.scales[layer], scores, output=not last)  # (B, Hq, Tr, Dv) | None
        if self._local is not None:  # the prompt's repeat at positions t + R + i: the prefill's queries, moved
            shift = a.rope(x, t + tr, 1, layer) if a.has_rope else None  # (cos, sin) of position t + R
            self._local.score(q, k, kr, shift, step.scales[layer], scores)
        if last:
            step.memo.pop(key, None)
        else:
            step.memo[key] = a.after_attn(layer, x, a.out(layer, y))  # the pass's hidden states, on to the next layer
        return scores

    def _pass(self, qr, k, v, kr, vr, scale: float, scores: torch.Tensor, output: bool = True
              ) -> Optional[torch.Tensor]:
        """The reconstruction queries ``qr (B, Hq, Tr, D)`` over the prompt's ``k, v (B, Hkv, T, D)`` and their own
        ``kr, vr (B, Hkv, Tr, D)`` (causal: query i sees the prompt and its own keys up to i) → the attention output
        ``(B, Hq, Tr, Dv)``, computed from the attention weights in blocks of ``chunk`` queries; the largest weight
        each prompt token gets from any query of its KV head's group is maxed into ``scores (B, Hkv, T)``. With
        ``output=False`` only the scores are formed (``None`` returned)."""
        b, hkv, t, d = k.shape
        tr, g = qr.shape[2], qr.shape[1] // hkv
        qg = (qr.float() * scale).reshape(b, hkv, g, tr, d)  # (B, Hkv, g, Tr, D): query head h reads KV head h // g
        kk = torch.cat([k.float(), kr.float()], 2)  # (B, Hkv, T + Tr, D): the prompt's keys, then the pass's own
        vv = torch.cat([v.float(), vr.float()], 2)  # (B, Hkv, T + Tr, Dv)
        y = qg.new_empty(b, hkv, g, tr, vv.shape[-1])  # (B, Hkv, g, Tr, Dv)
        for s in range(0, tr, self.chunk):
            e = min(tr, s + self.chunk)
            qc = qg[:, :, :, s:e].reshape(b, hkv, g * (e - s), d)  # (B, Hkv, g·c, D), rows (head in group, query)
            logits = qc @ kk[:, :, :t + e].transpose(-1, -2)  # (B, Hkv, g·c, T + e): every prompt key is seen
            hide = torch.arange(e, device=k.device)[None, :] > torch.arange(s, e, device=k.device)[:, None]  # (c, e)
            logits.view(b, hkv, g, e - s, t + e)[..., t:].masked_fill_(hide, float("-inf"))  # the pass's: causal
            p = torch.softmax(logits, dim=-1)  # over the prompt's and the pass's keys together
            torch.maximum(scores, p[..., :t].amax(dim=2), out=scores)
            if output:
                y[:, :, :, s:e] = (p @ vv[:, :, :t + e]).view(b, hkv, g, e - s, -1)
        return y.reshape(b, hkv * g, tr, -1).to(qr.dtype) if output else None  # (B, Hq, Tr, Dv)

    def __repr__(self) -> str:
        return f"KVzipSelection(budget={self.budget}, store={self.store!r})"


def _encode(tokenizer: Any, text: str) -> list[int]:
    """``text``'s token ids (no special tokens) from an HF ``tokenizers`` / ``transformers`` tokenizer."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    ids = list(getattr(ids, "ids", ids))
    if not ids:
        raise ValueError(f"the tokenizer gives no tokens for the reconstruction instruction {text!r}")
    return ids

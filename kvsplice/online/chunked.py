"""The chunked cache: online low-rank bases from Frequent Directions, one basis pair per chunk of tokens.

Per layer and KV head the cache holds a list of *closed chunks* plus one *active chunk*. Chunk ``j`` covers a
contiguous run of ``n_j`` tokens and stores their key coefficients ``a = k B_j`` ``(n_j, r_k)``, value coefficients
``b = v E_j`` ``(n_j, r_v)`` and its own orthonormal bases ``B_j (d, r_k)``, ``E_j (d_v, r_v)``. Attention runs chunk
by chunk with the blockwise softmax (:mod:`kvsplice.online.blockwise`): logits ``scale · (q B_j) · a_t``, output
``Σ_j (Σ_{t∈j} p_t b_t) E_jᵀ`` — no cached token is ever expanded back to ``d`` numbers.

**The online rule** (per layer; per KV head and sequence with ``granularity="head"``, the default):

1. *Warm-up.* The first ``warmup`` (W, default 16) tokens go into chunk 0 at full dimension (identity bases,
   ``r = d``; no basis is stored). With ``warmup=0`` the first chunk is seeded at token 0 from a sketch holding
   just that token.
2. Two Frequent Directions sketches per layer (:class:`kvsplice.online.fd.FrequentDirections`, ``ℓ = ell``, batched over
   (batch, KV heads)) are fed **every raw key and value**, in order.
3. Each new token ``t`` gets residual norms ``ρ_k = ‖k_t − B Bᵀ k_t‖`` and ``ρ_v = ‖v_t − E Eᵀ v_t‖`` against the
   active chunk's bases (absolute by default; with ``relative=True`` they are divided by ``‖k_t‖``, ``‖v_t‖``).
   The active chunk is closed *before* ``t`` when ``ρ_k > τ_k`` or ``ρ_v > τ_v`` (strict ``>``; ``None`` disables
   a threshold), or when the chunk already holds ``max_chunk_len`` (L) tokens (W for the warm-up chunk).
4. On a close at ``t`` the sketches are first fed up to and including ``t``; the new chunk's bases are the top-``r_k``
   / top-``r_v`` right singular vectors of the sketches, and ``t`` becomes the new chunk's first token
   *unconditionally* (even if its residual on the fresh bases still exceeds τ; recorded in the chunk's residual
   maximum). Every later token of a chunk has ``ρ ≤ τ`` — unless ``min_chunk_len = m > 1``, which suppresses
   residual closes while the active chunk holds fewer than ``m`` tokens (those tokens may exceed τ; their residuals
   are recorded), capping the basis overhead at ``(d r_k + d_v r_v)/m`` numbers per token.

   With ``fit_first_token=True`` the last basis column is instead the direction of ``t``'s residual off the top
   ``r − 1`` sketch directions, so ``t`` is represented exactly and *every* token of a chunk has ``ρ ≤ τ``
   (value basis too, unless shared).

   *Caveat, measured:* the sketch weighs the whole history, so after the keys' subspace drifts its top-``r``
   directions can stay mixed (old + new) for a long time; with a tight τ every token then closes its chunk (chunks
   of length 1, each carrying its own bases). ``fd_decay = γ < 1`` (a forgetting sketch, see
   :class:`~kvsplice.online.fd.FrequentDirections`) makes the seeds follow the drift; ``min_chunk_len`` bounds the cost.
5. Old tokens are never re-projected — except by the optional amortised merge with ``max_chunks``
   (:mod:`kvsplice.online.merge`).

With ``granularity="layer"`` all sequences and KV heads of a layer share chunk boundaries (a chunk closes when any of
them crosses a threshold) and are stored as batched tensors ``(B, Hkv, n_j, r)``: fewer, larger tensor ops.

Options: ``shared_value_basis=True`` fixes one value basis per stream (seeded at the first seeding, after warm-up,
from the value sketch, or given as ``value_bases``) used by every chunk; values then accumulate in one coefficient
space and are reconstructed once per query, and ``τ_v`` is ignored (closing cannot change the value basis).

Bytes (:meth:`ChunkedCache.nbytes`, the sum over :meth:`tensors`): :mod:`kvsplice.online.chunk_bytes`.
"""

from __future__ import annotations

import math
from typing import Iterator, Literal, Optional, Sequence

import torch

from kvsplice.online.chunk_bytes import held_tensors, nbytes_by_kind, unused_tail_nbytes
from kvsplice.online.chunks import Active, Stream, with_token
from kvsplice.online.fd import FrequentDirections
from kvsplice.online.merge import merge_chunks, oldest_to_merge
from models.cache import Cache

__all__ = ["ChunkedCache"]

Granularity = Literal["head", "layer"]


class ChunkedCache(Cache):
    """Chunked low-rank K/V cache with online FD bases, in the shared cache interface; see the module docstring.

    Shapes: ``append(layer, k=(B, Hkv, T_new, d), v=(B, Hkv, T_new, d_v))`` (returns nothing: the raw K/V are not
    kept; :meth:`reconstruct` gives the approximate ones). Attention over the chunks is
    :func:`kvsplice.online.attention.chunked_attention`, which reads :meth:`streams`.

    Options (defaults in brackets): ``rank_k``, ``rank_v`` [rank_k]; ``ell`` FD sketch size [2·max rank];
    ``max_chunk_len`` L [256]; ``min_chunk_len`` [1 = off]; ``tau_k``, ``tau_v`` [None = no residual closes];
    ``relative`` [False: absolute residual norms]; ``warmup`` W [16]; ``max_chunks`` J_max [None = never merge];
    ``shared_value_basis`` [False] or ``value_bases`` (one ``(Hkv, d_v, r_v)`` tensor per layer); ``fd_decay`` γ
    [1.0]; ``fit_first_token`` [False]; ``granularity`` ["head"]; ``dtype`` of coefficients and bases [float32]
    (the sketches are float32). Residual maxima are exact up to the rounding of the stored numbers.
    ``record_residuals`` [False]: log every token's criterion ``ρ_k``/``ρ_v`` (relative if ``relative``) against the
    bases of the chunk it is stored in (warm-up/identity chunks excluded; a chunk's first token against its fresh
    bases), read with :meth:`recorded_residuals` (used by :func:`kvsplice.online.method.calibrate_thresholds`).
    """

    kind = "chunked"

    def __init__(self, n_layer: int, n_kv_head: int, head_size: int, batch_size: int, *, rank_k: int,
                 rank_v: Optional[int] = None, value_head_size: Optional[int] = None, ell: Optional[int] = None,
                 max_chunk_len: int = 256, min_chunk_len: int = 1, tau_k: Optional[float] = None,
                 tau_v: Optional[float] = None, relative: bool = False, warmup: int = 16,
                 max_chunks: Optional[int] = None, shared_value_basis: bool = False,
                 value_bases: Optional[Sequence[torch.Tensor]] = None, fd_decay: float = 1.0,
                 fit_first_token: bool = False, granularity: Granularity = "head",
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 record_residuals: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.dtype = int(batch_size), dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.n_kv_head, self.head_size = int(n_kv_head), int(head_size)
        self.value_head_size = int(value_head_size or head_size)
        self.rank_k = int(rank_k)
        self.rank_v = int(rank_v if rank_v is not None else rank_k)
        if not 1 <= self.rank_k <= self.head_size or not 1 <= self.rank_v <= self.value_head_size:
            raise ValueError(f"ranks must be in [1, head size]: rank_k={self.rank_k} (d={self.head_size}), "
                             f"rank_v={self.rank_v} (d_v={self.value_head_size})")
        self.ell = int(ell if ell is not None else 2 * max(self.rank_k, self.rank_v))
        if max_chunk_len < 1 or warmup < 0 or self.ell < 1:
            raise ValueError(f"need max_chunk_len >= 1, warmup >= 0, ell >= 1; got {max_chunk_len}, {warmup}, "
                             f"{self.ell}")
        if max_chunks is not None and max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1 or None, got {max_chunks}")
        if granularity not in ("head", "layer"):
            raise ValueError(f"granularity must be 'head' or 'layer', got {granularity!r}")
        if not 1 <= min_chunk_len <= max_chunk_len:
            raise ValueError(f"need 1 <= min_chunk_len <= max_chunk_len, got {min_chunk_len}, {max_chunk_len}")
        self.max_chunk_len, self.warmup, self.max_chunks = int(max_chunk_len), int(warmup), max_chunks
        self.min_chunk_len = int(min_chunk_len)
        self.fit_first_token = bool(fit_first_token)
        self.record_residuals = bool(record_residuals)
        self.tau_k = math.inf if tau_k is None else float(tau_k)
        self.tau_v = math.inf if tau_v is None or shared_value_basis else float(tau_v)
        self.relative, self.granularity = bool(relative), granularity
        self.shared_value_basis = bool(shared_value_basis or value_bases is not None)
        self._given_value_bases = None
        if value_bases is not None:
            if len(value_bases) != n_layer:
                raise ValueError(f"value_bases needs one (Hkv, d_v, r_v) tensor per layer, got {len(value_bases)}")
            for e in value_bases:
                if tuple(e.shape) != (self.n_kv_head, self.value_head_size, self.rank_v):
                    raise ValueError(f"value basis shape must be {(self.n_kv_head, self.value_head_size, self.rank_v)}"
                                     f", got {tuple(e.shape)}")
            self._given_value_bases = [e.to(device=self.device, dtype=self.dtype) for e in value_bases]
        bs = (self.batch_size, self.n_kv_head)
        self.fd_k = [FrequentDirections(self.ell, self.head_size, bs, device=self.device, decay=fd_decay)
                     for _ in range(n_layer)]
        self.fd_v = [FrequentDirections(self.ell, self.value_head_size, bs, device=self.device, decay=fd_decay)
                     for _ in range(n_layer)]
        self.reset()

    # ------------------------------------------------------------------------------------------------ layout
    @property
    def n_layer(self) -> int:
        return len(self.fd_k)

    @property
    def seq_len(self) -> int:
        return min(self._lengths) if self._lengths else 0

    @property
    def position(self) -> int:
        return self.seq_len  # every token is kept (in some chunk): the next position is the count

    def layer_len(self, layer: int) -> int:
        return self._lengths[layer]

    def _make_streams(self) -> list[Stream]:
        if self.granularity == "layer":
            return [Stream(())]
        return [Stream((b, h)) for b in range(self.batch_size) for h in range(self.n_kv_head)]

    def _bs(self, s: Stream) -> tuple[int, ...]:
        return () if s.sel else (self.batch_size, self.n_kv_head)

    def reset(self) -> None:
        self._lengths = [0] * self.n_layer
        self._res_log: list[tuple[list, list]] = [([], []) for _ in range(self.n_layer)]
        for fd in self.fd_k + self.fd_v:
            fd.reset()
        self._streams = [self._make_streams() for _ in range(self.n_layer)]
        self._bases_at: list[Optional[tuple]] = [None] * self.n_layer
        for layer, streams in enumerate(self._streams):
            for s in streams:
                if self._given_value_bases is not None:
                    s.shared_e = self._given_value_bases[layer][s.sel[1:]].clone() if s.sel else \
                        self._given_value_bases[layer].expand(self.batch_size, -1, -1, -1).clone()
                if self.warmup:
                    s.active = Active(self._bs(s), self.head_size, self.value_head_size, None, None, 0,
                                       self.warmup, self.dtype, self.device, warmup=True)

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` tokens of every layer (e.g. to roll back decode steps): each stream's chunk
        holding token ``n − 1`` is active again (:meth:`~kvsplice.online.chunks.Stream.truncate`). The FD sketches
        cannot forget: they still include the removed tokens, so later seeds may differ from a cache that never saw
        them. ``truncate(0)`` is ``reset()``."""
        n = int(n)
        if n < 0 or any(n > length for length in self._lengths):
            raise ValueError(f"truncate({n}): must be between 0 and the tokens held by every layer "
                             f"({min(self._lengths) if self._lengths else 0})")
        if n == 0:
            self.reset()
            return
        for layer, streams in enumerate(self._streams):
            for s in streams:
                s.truncate(n, self.warmup, self.max_chunk_len)
            self._lengths[layer] = n

    def streams(self, layer: int) -> list[Stream]:
        return self._streams[layer]

    def chunk_lengths(self, layer: int) -> list[list[int]]:
        """Token counts of every chunk (closed + active), per stream of ``layer``."""
        return [[c.n for c in s.chunks()] for s in self._streams[layer]]

    def num_chunks(self, layer: int) -> list[int]:
        return [len(c) for c in self.chunk_lengths(layer)]

    # ------------------------------------------------------------------------------------------------ bases
    def _fresh_bases(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-r bases of the layer's sketches ``(B, Hkv, d, r)`` (cached until the sketches change)."""
        key = self.fd_k[layer].n_rows
        if self._bases_at[layer] is None or self._bases_at[layer][0] != key:
            ev = None if self.shared_value_basis else self.fd_v[layer].basis(self.rank_v)
            self._bases_at[layer] = (key, self.fd_k[layer].basis(self.rank_k), ev)
        return self._bases_at[layer][1], self._bases_at[layer][2]

    def _pick(self, s: Stream, x: torch.Tensor) -> torch.Tensor:
        """Stream ``s``'s part of a ``(B, Hkv, ...)`` tensor, as its own storage."""
        return x[s.sel].to(self.dtype).clone()

    # ------------------------------------------------------------------------------------------------ residuals
    def _project(self, x: torch.Tensor, basis: Optional[torch.Tensor], tau: float):
        """Coefficients, residual norms ``(*bs, m)`` and the exceed flags of ``x (*bs, m, d)`` (float32)."""
        if basis is None:
            zeros = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
            return x, zeros, torch.zeros_like(zeros, dtype=torch.bool)
        p = basis.to(x.dtype)
        coef = x @ p
        res = (x - coef @ p.transpose(-1, -2)).norm(dim=-1)  # (*bs, m)
        crit = res / x.norm(dim=-1).clamp_min(1e-30) if self.relative else res
        return coef, res, crit > tau

    def _next_close(self, s: Stream, kx: torch.Tensor, vx: torch.Tensor, i: int) -> int:
        """Index in the block of the first token at or after ``i`` that closes ``s``'s active chunk (``n``: none)."""
        n = kx.shape[-2]
        if i >= n:
            return n
        act = s.active
        if act is None:
            return i
        t_len = i + act.cap - act.n  # the first token that would not fit
        if act.warmup or t_len <= i:
            return min(max(t_len, i), n)
        end = min(t_len, n)
        _, _, ek = self._project(kx[s.sel][..., i:end, :], act.bk, self.tau_k)
        _, _, ev = self._project(vx[s.sel][..., i:end, :], act.be, self.tau_v)
        hit = (ek | ev).reshape(-1, end - i).any(0)  # any sequence/head of the stream
        if self.min_chunk_len > 1:  # no residual close while the chunk holds fewer than min_chunk_len tokens
            hit &= act.n + torch.arange(end - i, device=hit.device) >= self.min_chunk_len
        first = int(hit.nonzero()[0, 0]) if bool(hit.any()) else end - i
        return i + first if first < end - i else end

    def _push(self, s: Stream, kx: torch.Tensor, vx: torch.Tensor, i: int, j: int, layer: int = 0) -> None:
        if j <= i:
            return
        act = s.active
        kx, vx = kx[s.sel][..., i:j, :], vx[s.sel][..., i:j, :]
        a, rk, _ = self._project(kx, act.bk, math.inf)
        b, rv, _ = self._project(vx, act.be, math.inf)
        act.push(a.to(self.dtype), b.to(self.dtype), rk, rv)
        if self.record_residuals and act.bk is not None:  # the closing criterion, as _project computes it
            log_k, log_v = self._res_log[layer]
            for log, res, x in ((log_k, rk, kx), (log_v, rv, vx)):
                crit = res / x.norm(dim=-1).clamp_min(1e-30) if self.relative else res
                log.append(crit.detach().reshape(-1).float().cpu())  # (∏bs·m,): one criterion per token

    def _open(self, layer: int, s: Stream, start: int, k_first: torch.Tensor, v_first: torch.Tensor) -> None:
        """Open a chunk at ``start`` seeded from the sketches; ``k_first``/``v_first`` ``(*bs, d)``: its first token."""
        ek_all, ev_all = self._fresh_bases(layer)
        bk = ek_all[s.sel]
        if self.fit_first_token:
            bk = with_token(bk, k_first)
        if self.shared_value_basis and s.shared_e is None:
            s.shared_e = self._pick(s, self.fd_v[layer].basis(self.rank_v))
        if self.shared_value_basis:
            be = s.shared_e
        else:
            be = ev_all[s.sel]
            be = (with_token(be, v_first) if self.fit_first_token else be).to(self.dtype).clone()
        s.active = Active(self._bs(s), self.rank_k, self.rank_v, bk.to(self.dtype).clone(), be, start,
                           self.max_chunk_len, self.dtype, self.device)

    def _close(self, layer: int, s: Stream) -> None:
        if s.active is not None and s.active.n:
            s.closed.append(s.active.close())
            self._maybe_merge(layer, s)
        s.active = None

    def _maybe_merge(self, layer: int, s: Stream) -> None:
        span = None if self.max_chunks is None else oldest_to_merge(s.closed, self.max_chunks)
        if span is None:
            return
        ek_all, ev_all = self._fresh_bases(layer)
        be = s.shared_e if self.shared_value_basis else self._pick(s, ev_all)
        s.closed[span] = [merge_chunks(s.closed[span], self._pick(s, ek_all), be, self.dtype)]

    # ------------------------------------------------------------------------------------------------ interface
    def append(self, layer: int, **new: torch.Tensor) -> None:
        """Append ``k (B, Hkv, T_new, d)`` and ``v (B, Hkv, T_new, d_v)`` to ``layer`` by the online rule."""
        if set(new) != {"k", "v"}:
            raise KeyError(f"ChunkedCache.append takes k and v, got {sorted(new)}")
        k, v = new["k"], new["v"]
        bsz, h = self.batch_size, self.n_kv_head
        if k.dim() != 4 or tuple(k.shape[:2]) != (bsz, h) or k.shape[-1] != self.head_size:
            raise ValueError(f"k must be ({bsz}, {h}, T_new, {self.head_size}), got {tuple(k.shape)}")
        if tuple(v.shape) != (bsz, h, k.shape[2], self.value_head_size):
            raise ValueError(f"v must be ({bsz}, {h}, {k.shape[2]}, {self.value_head_size}), got {tuple(v.shape)}")
        self._ingest(layer, k, v)

    def _ingest(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n, base = k.shape[2], self._lengths[layer]
        kx = k.to(device=self.device, dtype=torch.promote_types(k.dtype, torch.float32))
        vx = v.to(device=self.device, dtype=torch.promote_types(v.dtype, torch.float32))
        fd_k, fd_v = self.fd_k[layer], self.fd_v[layer]
        streams = self._streams[layer]
        cursor = [0] * len(streams)
        cand = [self._next_close(s, kx, vx, 0) for s in streams]
        fed = 0
        while True:
            t = min(cand)
            if t >= n:
                break
            fd_k.update(kx[..., fed : t + 1, :])
            fd_v.update(vx[..., fed : t + 1, :])
            fed = t + 1
            for i, s in enumerate(streams):
                if cand[i] != t:
                    continue
                self._push(s, kx, vx, cursor[i], t, layer)
                self._close(layer, s)
                self._open(layer, s, base + t, kx[s.sel][..., t, :], vx[s.sel][..., t, :])
                self._push(s, kx, vx, t, t + 1, layer)  # the closing token starts the new chunk unconditionally
                cursor[i] = t + 1
                cand[i] = self._next_close(s, kx, vx, t + 1)
        fd_k.update(kx[..., fed:, :])
        fd_v.update(vx[..., fed:, :])
        for i, s in enumerate(streams):
            self._push(s, kx, vx, cursor[i], n, layer)
        self._lengths[layer] = base + n

    # ------------------------------------------------------------------------------------------------ reading
    def reconstruct(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The approximate ``K̂ (B, Hkv, T, d)``, ``V̂ (B, Hkv, T, d_v)`` in float32: ``a_t B_jᵀ``, ``b_t E_jᵀ``."""
        t = self._lengths[layer]
        kh = torch.zeros(self.batch_size, self.n_kv_head, t, self.head_size, device=self.device)
        vh = torch.zeros(self.batch_size, self.n_kv_head, t, self.value_head_size, device=self.device)
        for s in self._streams[layer]:
            for c in s.chunks():
                ka = c.a.float() if c.bk is None else c.a.float() @ c.bk.float().transpose(-1, -2)  # (*bs, n, d)
                vb = c.b.float() if c.be is None else c.b.float() @ c.be.float().transpose(-1, -2)  # (*bs, n, d_v)
                kh[s.sel][..., c.start : c.start + c.n, :] = ka
                vh[s.sel][..., c.start : c.start + c.n, :] = vb
        return kh, vh

    def residual_maxima(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Upper bounds on ``max_t ‖k_t − k̂_t‖`` and ``max_t ‖v_t − v̂_t‖`` over all tokens, ``(B, Hkv)`` each."""
        rk = torch.zeros(self.batch_size, self.n_kv_head, device=self.device)
        rv = torch.zeros_like(rk)
        for s in self._streams[layer]:
            for c in s.chunks():
                rk[s.sel] = torch.maximum(rk[s.sel], c.res_k.float())
                rv[s.sel] = torch.maximum(rv[s.sel], c.res_v.float())
        return rk, rv

    def recorded_residuals(self, layer: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token criteria logged with ``record_residuals=True`` (1-D float32 ``ρ_k``, ``ρ_v``; every
        sequence and KV head, in no particular order), for ``layer`` or (``None``) all layers; empty when off."""
        logs = self._res_log if layer is None else [self._res_log[layer]]
        out = []
        for i in (0, 1):
            parts = [x for log in logs for x in log[i]]
            out.append(torch.cat(parts) if parts else torch.zeros(0))
        return out[0], out[1]

    # ------------------------------------------------------------------------------------------------ bytes
    def tensors(self) -> Iterator[torch.Tensor]:
        for _, x in held_tensors(self._streams, self.fd_k, self.fd_v):
            yield x

    def nbytes_breakdown(self) -> dict[str, int]:
        return nbytes_by_kind(held_tensors(self._streams, self.fd_k, self.fd_v))

    def nbytes(self) -> int:
        return sum(self.nbytes_breakdown().values())

    def storage_nbytes(self) -> int:
        """``nbytes()`` plus the unused tail of the active chunks' grown buffers."""
        return self.nbytes() + unused_tail_nbytes(self._streams)

    def elements_per_token(self) -> float:
        """Average coefficients stored per token per sequence, summed over layers (bases and sketches excluded)."""
        t = self.seq_len
        if t == 0:
            return 0.0
        held = held_tensors(self._streams, self.fd_k, self.fd_v)
        return sum(x.numel() for kind, x in held if kind.endswith("coefficients")) / (t * self.batch_size)

    def __repr__(self) -> str:
        return (f"ChunkedCache(layers={self.n_layer}, batch={self.batch_size}, seq_len={self.seq_len}, "
                f"rank_k={self.rank_k}, rank_v={self.rank_v}, nbytes={self.nbytes()})")

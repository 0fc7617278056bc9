"""The pieces of a :class:`~kvsplice.online.chunked.ChunkedCache` stream: closed chunks (:class:`StoredChunk`), the active
chunk with its growing buffers (:class:`Active`), and one stream's list of both (:class:`Stream`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

@dataclass
class StoredChunk:
    """Tokens ``start .. start+n-1`` of one stream. ``a (*bs, n, r_k)``, ``b (*bs, n, r_v)``; bases None = identity.

    ``res_k`` / ``res_v`` ``(*bs,)``: an upper bound on ``max_t ‖k_t − k̂_t‖`` (``‖v_t − v̂_t‖``) over the chunk.
    """

    a: torch.Tensor
    b: torch.Tensor
    bk: Optional[torch.Tensor]
    be: Optional[torch.Tensor]
    start: int
    res_k: torch.Tensor
    res_v: torch.Tensor
    warmup: bool = False

    @property
    def n(self) -> int:
        return self.a.shape[-2]


class Active:
    """The open chunk: geometrically grown coefficient buffers up to ``cap`` tokens."""

    def __init__(self, bs, rk, rv, bk, be, start, cap, dtype, device, warmup=False) -> None:
        self.bk, self.be, self.start, self.cap, self.warmup = bk, be, start, cap, warmup
        self.n = 0
        alloc = min(cap, 16)
        self.a_buf = torch.empty(*bs, alloc, rk, dtype=dtype, device=device)
        self.b_buf = torch.empty(*bs, alloc, rv, dtype=dtype, device=device)
        self.res_k = torch.zeros(bs, dtype=torch.float32, device=device)
        self.res_v = torch.zeros(bs, dtype=torch.float32, device=device)

    def push(self, a: torch.Tensor, b: torch.Tensor, rk: torch.Tensor, rv: torch.Tensor) -> None:
        m = a.shape[-2]
        need = self.n + m
        if need > self.a_buf.shape[-2]:
            size = min(max(need, 2 * self.a_buf.shape[-2]), max(self.cap, need))
            for name in ("a_buf", "b_buf"):
                old = getattr(self, name)
                new = old.new_empty(*old.shape[:-2], size, old.shape[-1])
                new[..., : self.n, :] = old[..., : self.n, :]
                setattr(self, name, new)
        self.a_buf[..., self.n : need, :] = a
        self.b_buf[..., self.n : need, :] = b
        if m and rk is not None:
            self.res_k = torch.maximum(self.res_k, rk.amax(-1).float())
            self.res_v = torch.maximum(self.res_v, rv.amax(-1).float())
        self.n = need

    @classmethod
    def reopen(cls, c: StoredChunk, cap: int) -> "Active":
        """An active chunk holding (a copy of) the tokens of ``c``, to keep appending to it."""
        act = cls(tuple(c.res_k.shape), c.a.shape[-1], c.b.shape[-1], c.bk, c.be, c.start, max(cap, c.n),
                  c.a.dtype, c.a.device, warmup=c.warmup)
        act.push(c.a, c.b, None, None)
        act.res_k, act.res_v = c.res_k.clone(), c.res_v.clone()
        return act

    def view(self) -> StoredChunk:
        return StoredChunk(self.a_buf[..., : self.n, :], self.b_buf[..., : self.n, :], self.bk, self.be, self.start,
                      self.res_k, self.res_v, self.warmup)

    def close(self) -> StoredChunk:
        """The closed chunk, trimmed to its length (a copy unless the buffer is exactly full)."""
        c = self.view()  # StoredChunk: a (*bs, n, r_k), b (*bs, n, r_v)
        if self.a_buf.shape[-2] != self.n:
            c.a, c.b = c.a.clone(), c.b.clone()
        return c


class Stream:
    """One independently chunked stream: a (batch, KV head) pair (``sel = (b, h)``) or a whole layer (``sel = ()``)."""

    def __init__(self, sel: tuple) -> None:
        self.sel = sel
        self.closed: list[StoredChunk] = []
        self.active: Optional[Active] = None
        self.shared_e: Optional[torch.Tensor] = None

    def chunks(self) -> list[StoredChunk]:
        # StoredChunks in token order: a (*bs, n_j, r_k), b (*bs, n_j, r_v)
        return self.closed + ([self.active.view()] if self.active is not None and self.active.n else [])

    def truncate(self, n: int, warmup: int, cap: int) -> None:
        """Keep tokens ``0 .. n − 1`` (``n ≥ 1``): later chunks are dropped and the chunk holding token ``n − 1``
        becomes the active one again (same bases; up to ``warmup`` tokens for the warm-up chunk, else ``cap``)."""
        kept = []
        for c in self.chunks():
            if c.start >= n:
                break
            if c.start + c.n > n:
                m = n - c.start
                c = StoredChunk(c.a[..., :m, :], c.b[..., :m, :], c.bk, c.be, c.start, c.res_k, c.res_v, c.warmup)
            kept.append(c)
        last = kept.pop()
        self.closed = kept
        self.active = Active.reopen(last, warmup if last.warmup else cap)


def with_token(basis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``basis (*bs, d, r)`` with its last column replaced by the direction of ``x (*bs, d)`` off the first ``r − 1``
    columns (kept when ``x`` lies in their span): ``x`` is then represented exactly, columns stay orthonormal."""
    dt = basis.dtype
    head, x = basis[..., :-1].double(), x.double()
    u = x
    for _ in range(2):  # Gram–Schmidt twice: orthogonal to working precision even when x nearly lies in the span
        u = u - (head @ (head.transpose(-1, -2) @ u[..., None]))[..., 0]  # (*bs, d): u minus its projection on head
    norm = u.norm(dim=-1, keepdim=True)
    ok = norm > 1e-6 * x.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    last = torch.where(ok, u / norm.clamp_min(1e-300), basis[..., -1].double())
    return torch.cat([head, last[..., None]], -1).to(dt)

"""Grouped-head joint bases (Palu's G-LRD with one group = all KV heads of a layer): one latent per layer and token
for the keys of every KV head together, and one for the values, instead of per-head coefficients.

For layer ``l`` with ``Hkv`` KV heads of dim ``d``, the token's keys concatenated ``k = [k_0 … k_{Hkv−1}]`` (``Hkv·d``)
are cached as ``a = k @ K_enc`` (``R_k`` numbers) and rebuilt as ``k̂ = a @ K_decᵀ``; values likewise. Per-head bases
are the block-diagonal special case, so at equal numbers per token a joint basis is never worse on its objective.
Fits (:func:`fit_joint`) are the oblique construction (:func:`kvsplice.lowrank.fits.oblique_basis`) on the joint
Grams of :func:`kvsplice.lowrank.sensitivity.calibrate_all`: ``fisher`` — the joint loss-gradient Gram (predicted
NLL increase, the same unit as :mod:`kvsplice.lowrank.allocate`) — or ``kq`` — the block-diagonal of the groups'
query Grams (keys) and W_O Grams (values). :func:`allocate_joint` spends ``N`` numbers per token over layers and
keys/values by the predicted loss.

:class:`JointLowRank` is the storage method: ``(B, 1, T, R)`` latents per layer and kind (a
:class:`models.stream_cache.DecodeCache`), keys and values rebuilt for the attention call (pre-RoPE keys rotated at
their positions: :class:`kvsplice.core.rope.RopeTables`) and the one dense attention (mask, log-weights).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvsplice.adapters.base import apply_rope
from kvsplice.core.rope import RopeTables
from kvsplice.lowrank.calibrate import CalibrationStats
from kvsplice.lowrank.fit_errors import gram_error
from kvsplice.lowrank.fits import RCOND, oblique_basis
from kvsplice.lowrank.method import BasesStorage
from models.stream_cache import DecodeCache

__all__ = ["JointBases", "JointLowRank", "allocate_joint", "fit_joint"]


@dataclass
class JointBases:
    """``layers[l] = {"k_enc", "k_dec" (Hkv·d, R_k[l]), "v_enc", "v_dec" (Hkv·d, R_v[l])}``; ``rope``: key space."""

    layers: list[dict[str, torch.Tensor]]
    rope: str
    n_kv_head: int
    meta: dict[str, Any] = field(default_factory=dict)

    def ranks(self) -> dict[str, list[int]]:
        return {"k": [l["k_enc"].shape[1] for l in self.layers], "v": [l["v_enc"].shape[1] for l in self.layers]}

    def elements_per_token(self) -> int:
        r = self.ranks()
        return sum(r["k"]) + sum(r["v"])

    def to(self, *args, **kw) -> "JointBases":
        return JointBases([{n: t.to(*args, **kw) for n, t in l.items()} for l in self.layers], self.rope,
                          self.n_kv_head, dict(self.meta))

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        tensors = {f"layers.{i}.{n}": t.contiguous().cpu() for i, l in enumerate(self.layers) for n, t in l.items()}
        save_file(tensors, str(path), metadata={"kind": "kvsplice-joint-bases", "rope": self.rope,
                                                "n_kv_head": str(self.n_kv_head), "n_layer": str(len(self.layers)),
                                                "meta": json.dumps(self.meta, default=str)})
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> "JointBases":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as f:
            m = f.metadata() or {}
            if m.get("kind") != "kvsplice-joint-bases":
                raise ValueError(f"{path} is not a kvsplice joint-bases file")
            layers = [{n: f.get_tensor(f"layers.{i}.{n}") for n in ("k_enc", "k_dec", "v_enc", "v_dec")}
                      for i in range(int(m["n_layer"]))]
        return cls(layers, m["rope"], int(m["n_kv_head"]), json.loads(m.get("meta", "{}")))


def _targets(stats: CalibrationStats, layer: int, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The joint "query" Grams of keys and values: the loss-gradient Grams (``fisher``) or the block diagonals of
    the groups' query / W_O Grams (``kq``)."""
    n = max(stats.n_grad_tokens, 1)
    if method == "fisher":
        if stats.gk_joint is None:
            raise ValueError("joint fisher bases need the joint loss-gradient Grams (calibrate_all)")
        return stats.gk_joint[layer] / n, stats.gv_joint[layer] / n
    if method == "kq":
        h = stats.n_kv_head
        return (torch.block_diag(*[stats.query_gram(layer, j, "concat", True) for j in range(h)]),
                torch.block_diag(*[stats.output_gram(layer, j) for j in range(h)]))
    raise ValueError(f"joint bases: method must be 'fisher' or 'kq', got {method!r}")


def _grams(stats: CalibrationStats, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if stats.kk_joint is None:
        raise ValueError("joint bases need the joint Grams (kvsplice.lowrank.sensitivity.calibrate_all)")
    n = max(stats.n_tokens, 1)
    return stats.kk_joint[layer] / n, stats.vv_joint[layer] / n


def fit_joint(stats: CalibrationStats, ranks_k: list[int], ranks_v: list[int], method: str = "fisher",
              rcond: float = RCOND, dtype: torch.dtype = torch.float32) -> JointBases:
    """Joint bases of every layer at the given per-layer ranks."""
    layers = []
    for l in range(stats.n_layer):
        gk, gv = _grams(stats, l)
        tk, tv = _targets(stats, l, method)
        kb, vb = oblique_basis(gk, tk, ranks_k[l], rcond=rcond), oblique_basis(gv, tv, ranks_v[l], rcond=rcond)
        layers.append({"k_enc": kb.enc.to(dtype), "k_dec": kb.dec.to(dtype), "v_enc": vb.enc.to(dtype),
                       "v_dec": vb.dec.to(dtype)})
    return JointBases(layers, stats.rope, stats.n_kv_head, {"method": method, "fingerprint": stats.fingerprint,
                                                            "calibration_tokens": stats.n_tokens})


def allocate_joint(stats: CalibrationStats, numbers_per_token: int, method: str = "fisher") -> JointBases:
    """Joint bases whose per-layer key / value ranks spend ``numbers_per_token`` by the predicted loss: the cost
    ``½·tr(Zᵀ G Z G_F)`` with the joint loss-gradient Gram ``G_F`` whatever the fit, greedy over every layer and
    kind (:func:`kvsplice.lowrank.allocate.greedy_ranks`)."""
    from kvsplice.lowrank.allocate import greedy_ranks

    if stats.gk_joint is None:
        raise ValueError("joint allocation needs the joint loss-gradient Grams (calibrate_all)")
    curves, n = {}, max(stats.n_grad_tokens, 1)
    for l in range(stats.n_layer):
        targets = _targets(stats, l, method)
        for i, (kind, g) in enumerate(zip("kv", _grams(stats, l))):
            f = (stats.gk_joint if kind == "k" else stats.gv_joint)[l] / n
            full = oblique_basis(g, targets[i], g.shape[0])
            curves[(l, 0, kind)] = [0.5 * float(torch.trace(g.double() @ f.double()))] + \
                [0.5 * gram_error(g, f, full.enc[:, :r], full.dec[:, :r])[0] for r in range(1, g.shape[0] + 1)]
    rank = greedy_ranks(curves, numbers_per_token, stats.n_kv_head * stats.head_dim)
    bases = fit_joint(stats, [rank[(l, 0, "k")] for l in range(stats.n_layer)],
                      [rank[(l, 0, "v")] for l in range(stats.n_layer)], method)
    bases.meta["predicted_nll"] = sum(curves[g][r] for g, r in rank.items())
    return bases


class JointLowRank(BasesStorage):
    """Grouped-head joint latents per layer (see the module docstring); a storage method."""

    name = "joint-lowrank"
    cache_type = DecodeCache
    bases_type = JointBases

    def _prepare(self, adapter, *, dtype, device):
        super()._prepare(adapter, dtype=dtype, device=device)
        b = self.bases
        if len(b.layers) != adapter.n_layer or b.n_kv_head != adapter.n_kv_head or \
                b.layers[0]["k_enc"].shape[0] != adapter.n_kv_head * adapter.head_dim:
            raise ValueError(f"joint bases ({len(b.layers)} layers, {b.n_kv_head} KV heads) do not fit the model")
        self.key_rope = "pre" if adapter.has_rope and b.rope == "pre" else "post"
        self.bases = b.to(device=device, dtype=dtype)
        self.rope = RopeTables(adapter.rotary_embedding()) if self.key_rope == "pre" else None

    def new_cache(self, batch_size, capacity=None, *, dtype, device):
        r = self.bases.ranks()
        return DecodeCache([{"k": (1, rk), "v": (1, rv)} for rk, rv in zip(r["k"], r["v"])], batch_size,
                           dtype=dtype, device=device, capacity=capacity)

    def bytes_formula(self, batch_size, n_held, dtype):
        return self.bases.elements_per_token() * batch_size * n_held * torch.empty((), dtype=dtype).element_size()

    def _encode(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k, v (B, Hkv, T, d)`` → latents ``(B, 1, T, R)``."""
        b, h, t, d = k.shape
        L = self.bases.layers[layer]
        flat = lambda x: x.transpose(1, 2).reshape(b, 1, t, h * d)  # noqa: E731  (B, 1, T, Hkv·d)
        return flat(k) @ L["k_enc"], flat(v) @ L["v_enc"]

    def _decode(self, c: torch.Tensor, dec: torch.Tensor, h: int) -> torch.Tensor:
        """Latents ``(B, 1, T, R)`` → ``(B, Hkv, T, d)``."""
        x = c[:, 0] @ dec.T  # (B, T, Hkv·d)
        return x.view(x.shape[0], x.shape[1], h, -1).transpose(1, 2)

    def append(self, layer, k, v, cache, step):
        if self.key_rope == "pre":
            raise ValueError("pre-RoPE joint latents need their keys' positions; a token subset needs post-RoPE")
        a, bv = self._encode(layer, k.to(cache.dtype), v.to(cache.dtype))
        cache.append(layer, k=a, v=bv)

    def attend(self, layer, q, k, v, cache, step, mask=None, logw=None):
        out_dtype = q.dtype
        k, v = k.to(cache.dtype), v.to(cache.dtype)
        h, t_q = k.shape[1], k.shape[2]
        if self.key_rope == "pre":
            cos, sin = self.rope.cos_sin(step, mask, cache.layer_len(layer) + t_q, k)  # (B or 1, Tk, d)
            if step.k_rotated:  # undo the rotation of the new keys: k = (k_rot⊙cos − rot(k_rot)⊙sin)/σ²
                c, s = cos[:, None, -t_q:], sin[:, None, -t_q:]  # (B or 1, 1, Tq, d)
                k = self.rope.unrotate(k, c, s)
        a, bv = self._encode(layer, k, v)
        held = cache.append(layer, k=a, v=bv)  # (B, 1, Tk, R_k), (B, 1, Tk, R_v)
        L = self.bases.layers[layer]
        k_hat, v_hat = self._decode(held["k"], L["k_dec"], h), self._decode(held["v"], L["v_dec"], h)
        if self.key_rope == "pre":
            k_hat = apply_rope(k_hat, cos, sin)  # rotated at the keys' positions
        y = step.attend(layer, q.to(cache.dtype), k_hat, v_hat, mask=mask, logw=logw)  # (B, Hq, Tq, d)
        return y.to(out_dtype)

    def __repr__(self) -> str:
        return f"JointLowRank({self.bases.meta.get('method')}, rope={self.bases.rope}, " \
               f"{self.bases.elements_per_token()} numbers/token)"

"""Low-rank KV bases for post-training compression: the container every fit returns and every apply path reads.

For one KV head with head dim ``d``:

* keys — cached coefficients ``a = k @ k_enc`` (R_k numbers per token); a query is projected once per step,
  ``q̃ = q @ k_dec``, and the score is ``q̃ · a ≈ q · k``. (K-only SVD has ``k_enc = k_dec = P``; the
  attention-aware fit is oblique, ``k_enc ≠ k_dec``.) The key itself, where it must be rebuilt (pre-RoPE), is
  ``k̂ = a @ k_decᵀ``.
* values — cached coefficients ``b = v @ v_enc`` (R_v numbers per token); the value is ``v̂ = b @ v_decᵀ``, and since
  attention is linear in values, ``Σ_t p_t v̂_t = (Σ_t p_t b_t) @ v_decᵀ``: the reconstruction folds into the output
  projection (``v_decᵀ W_O``) and is never done per cached token.

Saved as safetensors (tensors ``layers.{l}.heads.{j}.{k_enc,k_dec,v_enc,v_dec}``) with JSON metadata: the model
fingerprint, method, RoPE mode, ranks and calibration token count. Loading never unpickles anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file

RopeMode = Literal["post", "pre", "none"]
FORMAT_VERSION = 1


class BasesMismatchError(ValueError):
    """Bases were fitted for a different model (fingerprint or shapes differ)."""


@dataclass
class HeadBases:
    """Bases of one KV head. Shapes: ``k_enc, k_dec (d, R_k)``; ``v_enc, v_dec (d, R_v)``."""

    k_enc: torch.Tensor
    k_dec: torch.Tensor
    v_enc: torch.Tensor
    v_dec: torch.Tensor

    def __post_init__(self) -> None:
        if self.k_enc.shape != self.k_dec.shape or self.v_enc.shape != self.v_dec.shape:
            raise ValueError(f"enc/dec shapes differ: k {tuple(self.k_enc.shape)} vs {tuple(self.k_dec.shape)}, "
                             f"v {tuple(self.v_enc.shape)} vs {tuple(self.v_dec.shape)}")

    @property
    def rank_k(self) -> int:
        return self.k_enc.shape[1]

    @property
    def rank_v(self) -> int:
        return self.v_enc.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k_enc.shape[0]


@dataclass
class KVBases:
    """``layers[l][j]`` holds the bases of KV head ``j`` of layer ``l``."""

    layers: list[list[HeadBases]]
    method: str
    rope: RopeMode = "post"
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    @property
    def n_kv_head(self) -> int:
        return len(self.layers[0])

    def ranks(self) -> dict[str, list[list[int]]]:
        return {"k": [[h.rank_k for h in layer] for layer in self.layers],
                "v": [[h.rank_v for h in layer] for layer in self.layers]}

    def elements_per_token(self) -> int:
        """Cached numbers per token per sequence: ``Σ_layers Σ_kv-heads (R_k + R_v)``."""
        return sum(h.rank_k + h.rank_v for layer in self.layers for h in layer)

    def to(self, *args, **kw) -> "KVBases":
        layers = [[HeadBases(*(t.to(*args, **kw) for t in (h.k_enc, h.k_dec, h.v_enc, h.v_dec))) for h in layer]
                  for layer in self.layers]
        return KVBases(layers, self.method, self.rope, dict(self.meta))

    def check_model(self, fingerprint: str) -> None:
        got = self.meta.get("model_fingerprint")
        if got is not None and got != fingerprint:
            raise BasesMismatchError(
                f"these bases were fitted for model {got}, not {fingerprint}; fit bases for this model with "
                f"kvsplice fit-bases")

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        tensors = {}
        for l, layer in enumerate(self.layers):
            for j, h in enumerate(layer):
                for name in ("k_enc", "k_dec", "v_enc", "v_dec"):
                    tensors[f"layers.{l}.heads.{j}.{name}"] = getattr(h, name).detach().contiguous().cpu()
        meta = {"format_version": str(FORMAT_VERSION), "method": self.method, "rope": self.rope,
                "n_layer": str(self.n_layer), "n_kv_head": str(self.n_kv_head),
                "ranks": json.dumps(self.ranks()), "meta": json.dumps(self.meta, default=str)}
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=meta)
        return path

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> "KVBases":
        """Read a file written by :meth:`save`. Every tensor is checked (:func:`check_file_tensors`): a file of another
        format, with NaN/inf values, integer tensors or inconsistent shapes raises :class:`BasesMismatchError`
        naming the file and the tensor."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"bases file not found: {path}")
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                meta = f.metadata() or {}
                if meta.get("format_version") != str(FORMAT_VERSION):
                    raise BasesMismatchError(f"{path} is not a kvsplice bases file (format_version="
                                             f"{meta.get('format_version')!r}, expected {FORMAT_VERSION})")
                n_layer, n_kv = int(meta["n_layer"]), int(meta["n_kv_head"])
                if n_layer < 1 or n_kv < 1:
                    raise BasesMismatchError(f"{path}: n_layer={n_layer}, n_kv_head={n_kv} in its metadata")
                tensors = [[{n: f.get_tensor(f"layers.{l}.heads.{j}.{n}") for n in _NAMES} for j in range(n_kv)]
                           for l in range(n_layer)]
                bases = cls([[HeadBases(**check_file_tensors(path, l, j, head)) for j, head in enumerate(layer)]
                             for l, layer in enumerate(tensors)],
                            meta["method"], meta["rope"], json.loads(meta.get("meta", "{}")))
        except BasesMismatchError:
            raise
        except (OSError, KeyError, ValueError) as e:
            raise BasesMismatchError(f"cannot read bases from {path}: {e}") from None
        except Exception as e:  # safetensors raises its own error type for corrupt headers
            raise BasesMismatchError(f"cannot read bases from {path}: {e}") from None
        head_dims = {(h.k_enc.shape[0], h.v_enc.shape[0]) for layer in bases.layers for h in layer}
        if len(head_dims) > 1:
            raise BasesMismatchError(f"{path}: the heads' key/value dims differ ({sorted(head_dims)})")
        return bases


_NAMES = ("k_enc", "k_dec", "v_enc", "v_dec")


def check_file_tensors(path: Path, layer: int, head: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One head's tensors from a bases file: finite floating-point matrices ``(d, R)`` with ``1 <= R <= d``, the
    encoder and decoder of keys (values) of one shape. Raises :class:`BasesMismatchError` naming file and tensor."""
    from models.checkpoint import check_tensor

    prefix = f"layers.{layer}.heads.{head}."
    for n in _NAMES:
        t = tensors[n]
        name = prefix + n
        try:
            check_tensor(t, str(path), name, shape=tensors[n[0] + "_enc"].shape if n.endswith("dec") else None)
        except ValueError as e:
            raise BasesMismatchError(str(e)) from None
        if t.dim() != 2 or not 1 <= t.shape[1] <= t.shape[0]:
            raise BasesMismatchError(f"{path}: tensor {name} has shape {tuple(t.shape)}, expected (head_dim, rank) "
                                     f"with 1 <= rank <= head_dim")
    return tensors

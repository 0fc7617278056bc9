"""Calibration statistics for post-training low-rank KV bases: streamed d×d Gram matrices, never activations.

Run a model over calibration batches with forward hooks and accumulate, per layer, in float64:

* ``kk``   ``(L, Hkv, d, d)``  ``Σ_t k_t k_tᵀ`` per KV head (``KᵀK``);
* ``qq``   ``(L, Hq, d, d)``   ``Σ_t q_t q_tᵀ`` per *query* head (``Q_hᵀQ_h``); the group's Gram ``Σ_{h∈j} Q_hᵀQ_h``
  (GQA "concat" objective) is a sum of these;
* ``qsum`` ``(L, Hkv, d, d)``  Gram of the group-summed queries ``(Σ_{h∈j} Q_h)ᵀ(Σ_{h∈j} Q_h)`` (GQA "sum"
  objective; it needs the cross terms, so it is accumulated separately; equals ``qq`` for MHA);
* ``vv``   ``(L, Hkv, d, d)``  ``Σ_t v_t v_tᵀ`` per KV head;
* ``wo``   ``(L, Hq, d_model, d)`` the output projection's slice per query head, stored once (not accumulated):
  the layer output is ``y = Σ_h o_h @ wo[h]ᵀ`` (``wo[h] = W_O[:, h·d:(h+1)·d]`` in ``nn.Linear`` layout).

Query head ``h`` reads KV head ``h // g`` with ``g = Hq / Hkv`` (HF ``repeat_kv`` convention). Queries are the raw
projections (after RoPE in ``post`` mode) *without* the softmax scale ``1/√d``: a scalar on a Gram changes none of
the attention-aware fits (it matters only for ``eigen``'s joint Gram, which documents this choice).

Memory is ``O(L·H·d²)`` whatever the number of calibration tokens: each hook turns its activations into Gram
updates and drops them.

RoPE: ``rope="post"`` (default for rotary models) records keys/queries after the rotary embedding — the cache then
stores coefficients of rotated keys, so calibrate over the whole position range you will decode at; ``"pre"``
records the projections before RoPE (the apply path must rebuild ``k̂`` and rotate it). Models without RoPE
(GPT-2) always record ``"none"``.

Supported models: ``transformers`` ``LlamaForCausalLM`` / ``LlamaModel`` (GQA + RoPE), ``GPT2LMHeadModel`` /
``GPT2Model``, and this project's ``models.GPT`` with ``attention="mha"``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, Optional

import torch
from torch import nn

from kvsplice.adapters import FamilyAdapter, ModelInfo, adapter_for, model_fingerprint
from kvsplice.adapters.capture import RopeMode, resolve_rope, run_with_qkv_hooks
from models.checkpoint import check_tensor

STATS_FORMAT_VERSION = 1

__all__ = ["CalibrationStats", "calibrate", "calibration_batches", "iter_token_batches", "load_stats", "save_stats"]


def _output_slices(adapter: FamilyAdapter) -> torch.Tensor:
    """``(L, Hq, d_model, d)`` float64: ``W_O[:, h·d:(h+1)·d]`` per layer and query head."""
    slices = []
    for layer in range(adapter.n_layer):
        wo = adapter.proj(layer).wo.detach().to("cpu", torch.float64)  # (d_model, Hq·d)
        # (Hq, d_model, d)
        slices.append(wo.view(wo.shape[0], adapter.n_head, adapter.head_dim).permute(1, 0, 2).contiguous())
    return torch.stack(slices)  # (L, Hq, d_model, d)


# ------------------------------------------------------------------------------------------------- the stats
@dataclass
class CalibrationStats:
    """Streamed second moments of one model's keys, queries and values (all float64, raw sums over tokens).

    Shapes (``L`` layers, ``Hq`` query heads, ``Hkv`` KV heads, head dim ``d``):
    ``kk (L, Hkv, d, d)``, ``qq (L, Hq, d, d)``, ``qsum (L, Hkv, d, d)``, ``vv (L, Hkv, d, d)``,
    ``wo (L, Hq, d_model, d)``. ``n_tokens`` tokens were seen (every Gram sums over the same tokens; divide by it
    for per-token second moments). See the module docstring for definitions.
    """

    kk: torch.Tensor
    qq: torch.Tensor
    qsum: torch.Tensor
    vv: torch.Tensor
    wo: torch.Tensor
    n_tokens: int
    rope: RopeMode
    family: str
    n_head: int
    n_kv_head: int
    head_dim: int
    fingerprint: Optional[str] = None
    meta: dict[str, Any] = field(default_factory=dict)
    # optional (kvsplice.lowrank.sensitivity.calibrate_all): the layer's KV heads jointly, and loss sensitivities
    kk_joint: Optional[torch.Tensor] = None  # (L, Hkv·d, Hkv·d) Σ_t [k_t,0; …; k_t,Hkv−1] [...]ᵀ
    vv_joint: Optional[torch.Tensor] = None  # (L, Hkv·d, Hkv·d)
    gk: Optional[torch.Tensor] = None  # (L, Hkv, d, d) Σ_t g_t g_tᵀ, g_t = ∂(Σ NLL)/∂k_t (keys in this RoPE mode)
    gv: Optional[torch.Tensor] = None  # (L, Hkv, d, d) the same for the values
    gk_joint: Optional[torch.Tensor] = None  # (L, Hkv·d, Hkv·d)
    gv_joint: Optional[torch.Tensor] = None  # (L, Hkv·d, Hkv·d)
    n_grad_tokens: int = 0  # tokens the gradient Grams sum over

    _TENSORS = ("kk", "qq", "qsum", "vv", "wo")
    _OPTIONAL = ("kk_joint", "vv_joint", "gk", "gv", "gk_joint", "gv_joint")

    @classmethod
    def zeros(cls, info: ModelInfo, rope: RopeMode, wo: torch.Tensor, fingerprint: Optional[str] = None
              ) -> "CalibrationStats":
        L, hq, hkv, d = info.n_layer, info.n_head, info.n_kv_head, info.head_dim
        z = lambda h: torch.zeros(L, h, d, d, dtype=torch.float64)  # noqa: E731
        return cls(z(hkv), z(hq), z(hkv), z(hkv), wo, 0, rope, info.family, hq, hkv, d, fingerprint)

    # ------------------------------------------------------------------------------------------ derived
    @property
    def n_layer(self) -> int:
        return self.kk.shape[0]

    @property
    def group_size(self) -> int:
        return self.n_head // self.n_kv_head

    @property
    def d_model(self) -> int:
        return self.wo.shape[2]

    def group(self, j: int) -> range:
        """The query heads served by KV head ``j``."""
        g = self.group_size
        return range(j * g, (j + 1) * g)

    def key_gram(self, layer: int, j: int, normalize: bool = False) -> torch.Tensor:
        """``KᵀK`` of KV head ``j`` (divided by ``n_tokens`` if ``normalize``)."""
        return self.kk[layer, j] / self._n(normalize)

    def value_gram(self, layer: int, j: int, normalize: bool = False) -> torch.Tensor:
        return self.vv[layer, j] / self._n(normalize)

    def query_gram(self, layer: int, j: int, gqa: Literal["concat", "sum"] = "concat",
                   normalize: bool = False) -> torch.Tensor:
        """Query Gram of KV head ``j``'s group: ``Σ_h Q_hᵀQ_h`` (``concat``) or ``(Σ_h Q_h)ᵀ(Σ_h Q_h)`` (``sum``)."""
        if gqa == "concat":
            g = self.qq[layer, self.group(j)].sum(0)
        elif gqa == "sum":
            g = self.qsum[layer, j]
        else:
            raise ValueError(f"gqa must be 'concat' or 'sum', got {gqa!r}")
        return g / self._n(normalize)

    def output_slices(self, layer: int, j: int) -> torch.Tensor:
        """``(g, d_model, d)``: the W_O slices of the query heads that read KV head ``j``."""
        return self.wo[layer, self.group(j)]

    def output_gram(self, layer: int, j: int) -> torch.Tensor:
        """``Σ_{h∈group(j)} W_O[h]ᵀ W_O[h]`` ``(d, d)``: the value side's "query" Gram."""
        w = self.output_slices(layer, j)
        return torch.einsum("gmd,gme->de", w, w)

    def _n(self, normalize: bool) -> float:
        return float(max(self.n_tokens, 1)) if normalize else 1.0

    def nbytes(self) -> int:
        """Bytes held by the statistics' tensors (constant in the number of calibration tokens)."""
        return sum(t.numel() * t.element_size() for t in self._tensors().values())

    def _tensors(self) -> dict[str, torch.Tensor]:
        out = {n: getattr(self, n) for n in self._TENSORS}
        out.update({n: getattr(self, n) for n in self._OPTIONAL if getattr(self, n) is not None})
        return out

    @property
    def has_sensitivity(self) -> bool:
        """The loss-gradient Grams (``gk``, ``gv``) are present: fisher fits and rank allocation can use them."""
        return self.gk is not None and self.gv is not None and self.n_grad_tokens > 0

    def grad_gram(self, kind: str, layer: int, j: int, normalize: bool = True) -> torch.Tensor:
        """``Σ_t g_t g_tᵀ`` of KV head ``j``'s keys (``kind="k"``) or values (``"v"``), per gradient token if
        ``normalize``."""
        g = self.gk if kind == "k" else self.gv
        if g is None:
            raise ValueError("these calibration stats hold no loss gradients (calibrate with sensitivity=True)")
        return g[layer, j] / (float(max(self.n_grad_tokens, 1)) if normalize else 1.0)

    # ------------------------------------------------------------------------------------------ I/O
    def _header(self) -> dict[str, Any]:
        return {"n_tokens": self.n_tokens, "rope": self.rope, "family": self.family, "n_head": self.n_head,
                "n_kv_head": self.n_kv_head, "head_dim": self.head_dim, "fingerprint": self.fingerprint or "",
                "n_grad_tokens": self.n_grad_tokens, "meta": self.meta}

    def save(self, path: str | Path) -> Path:
        """One set of statistics in a safetensors file (:func:`save_stats` holds several RoPE modes in one)."""
        return save_stats(path, {self.rope: self})

    @classmethod
    def load(cls, path: str | Path, rope: Optional[str] = None) -> "CalibrationStats":
        """The statistics of RoPE mode ``rope`` (default: the file's only mode) from :meth:`save` /
        :func:`save_stats`."""
        sets = load_stats(path)
        if rope is None and len(sets) == 1:
            return next(iter(sets.values()))
        if rope not in sets:
            raise ValueError(f"{path} holds calibration stats for RoPE modes {sorted(sets)}, not {rope!r}")
        return sets[rope]


def save_stats(path: str | Path, sets: dict[str, CalibrationStats]) -> Path:
    """Several :class:`CalibrationStats` of one model (one per RoPE mode) in one safetensors file: tensors
    ``{mode}.{name}``, the headers as JSON metadata. Written to ``path`` directly (callers write atomically)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {f"{mode}.{n}": t.contiguous().clone() for mode, s in sets.items() for n, t in s._tensors().items()}
    meta = {"format_version": str(STATS_FORMAT_VERSION), "kind": "kvsplice-calibration-stats",
            "sets": json.dumps({mode: s._header() for mode, s in sets.items()}, default=str)}
    save_file(tensors, str(path), metadata=meta)
    return path


def load_stats(path: str | Path) -> dict[str, CalibrationStats]:
    """RoPE mode → :class:`CalibrationStats` from :func:`save_stats`; ``ValueError`` (one line) for another file or
    a tensor holding NaN / inf (a fit would fail on it, or silently fit garbage)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            m = f.metadata() or {}
            if m.get("format_version") != str(STATS_FORMAT_VERSION) or "sets" not in m:
                raise ValueError(f"{path} is not a kvsplice calibration-stats file")
            names = set(f.keys())
            out = {}

            def tensor(name: str) -> torch.Tensor:  # floating point, finite: a NaN / inf never reaches a fit
                return check_tensor(f.get_tensor(name), str(path), name)

            for mode, h in json.loads(m["sets"]).items():
                t = {n: tensor(f"{mode}.{n}") for n in CalibrationStats._TENSORS}
                t.update({n: tensor(f"{mode}.{n}") for n in CalibrationStats._OPTIONAL if f"{mode}.{n}" in names})
                out[mode] = CalibrationStats(**t, n_tokens=int(h["n_tokens"]), rope=h["rope"], family=h["family"],
                                             n_head=int(h["n_head"]), n_kv_head=int(h["n_kv_head"]),
                                             head_dim=int(h["head_dim"]), fingerprint=h["fingerprint"] or None,
                                             meta=h.get("meta", {}), n_grad_tokens=int(h.get("n_grad_tokens", 0)))
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors' own errors for a file of another kind
        raise ValueError(f"cannot read calibration stats from {path}: {str(e).splitlines()[0] if str(e) else e}") \
            from None
    return out


def calibrate(model: nn.Module, batches: Iterable[torch.Tensor], *, rope: Optional[RopeMode] = None,
              progress: bool = True, total: Optional[int] = None) -> CalibrationStats:
    """Stream ``batches`` (LongTensor ``(B, T)`` token ids) through ``model`` and return the Grams.

    ``rope``: ``"post"`` (default for RoPE models: keys/queries after the rotary embedding, as the attention sees
    them) or ``"pre"`` (the q/k projections before RoPE); ignored for models without RoPE (recorded as ``"none"``).
    Each batch is run as full sequences at positions ``0..T-1`` (no padding). The model is put in eval mode for
    the pass (and restored), runs under ``torch.no_grad()``, and every hook is removed afterwards.
    """
    adapter = adapter_for(model)
    adapter.require_projections()
    info = adapter.info()
    rope_mode = resolve_rope(info, rope)
    stats = CalibrationStats.zeros(info, rope_mode, _output_slices(adapter), model_fingerprint(model))
    g = info.group_size

    def gram_into(acc: torch.Tensor, x: torch.Tensor) -> None:
        # acc (H, d, d) += Σ_t x_t x_tᵀ for x (B, H, T, d)
        x = x.detach().to(torch.float64).transpose(0, 1).reshape(x.shape[1], -1, x.shape[-1])  # (H, B·T, d)
        acc += (x.transpose(1, 2) @ x).cpu()  # (H, d, d)

    def sink(layer: int, kind: str, x: torch.Tensor) -> None:
        if kind == "k":
            gram_into(stats.kk[layer], x)
        elif kind == "v":
            gram_into(stats.vv[layer], x)
        else:
            gram_into(stats.qq[layer], x)
            b, _, n, d = x.shape  # (B, Hq, T, d): query heads of a KV head are contiguous
            xs = x.reshape(b, info.n_kv_head, g, n, d).sum(2) if g > 1 else x  # (B, Hkv, T, d)
            gram_into(stats.qsum[layer], xs)

    stats.n_tokens = run_with_qkv_hooks(model, adapter, rope_mode, sink, batches, progress, total,
                          desc=f"calibrate ({rope_mode})")
    return stats


# ------------------------------------------------------------------------------------------------- batching
def calibration_batches(token_ids: torch.Tensor, seq_len: int, batch_size: int = 8,
                        max_tokens: Optional[int] = None) -> list[torch.Tensor]:
    """Cut a 1-D token stream into non-overlapping windows of ``seq_len`` and group them into batches.

    Returns a list of ``(≤batch_size, seq_len)`` LongTensors (views of ``token_ids``, no copy); the trailing
    partial window is dropped and at most ``max_tokens // seq_len`` windows are used. Use the model's context
    length as ``seq_len`` for post-RoPE bases so every position is calibrated.
    """
    token_ids = torch.as_tensor(token_ids, dtype=torch.long)
    if token_ids.dim() != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
    n = token_ids.numel() // seq_len
    if max_tokens is not None:
        n = min(n, max_tokens // seq_len)
    if n < 1:
        raise ValueError(f"need at least seq_len={seq_len} tokens (and max_tokens >= seq_len), got "
                         f"{token_ids.numel()} tokens, max_tokens={max_tokens}")
    windows = token_ids[: n * seq_len].view(n, seq_len)  # (N, T)
    return list(windows.split(batch_size))


def iter_token_batches(texts: Iterable[str], encode: Callable[[str], list[int]], seq_len: int,
                       batch_size: int = 8, max_tokens: Optional[int] = None) -> Iterator[torch.Tensor]:
    """Stream-tokenise ``texts`` and yield ``(batch_size, seq_len)`` batches without materialising the corpus
    (for calibration sets too large to tokenise up front). Stops after ``max_tokens`` tokens."""
    buf: list[int] = []
    rows: list[list[int]] = []
    seen = 0
    for text in texts:
        buf.extend(encode(text))
        while len(buf) >= seq_len:
            if max_tokens is not None and seen + seq_len > max_tokens:
                break
            rows.append(buf[:seq_len])
            del buf[:seq_len]
            seen += seq_len
            if len(rows) == batch_size:
                yield torch.tensor(rows, dtype=torch.long)
                rows = []
        if max_tokens is not None and seen + seq_len > max_tokens:
            break
    if rows:
        yield torch.tensor(rows, dtype=torch.long)

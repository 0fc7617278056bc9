"""One calibration pass for every method, rank and RoPE mode: the Grams of :mod:`kvsplice.lowrank.calibrate` for
several RoPE modes at once, the layer's KV heads jointly, and the loss sensitivity of every key and value.

:func:`calibrate_all` streams the calibration batches through the model once, with the q/k/v hooks of every
requested RoPE mode attached together; with ``sensitivity=True`` the pass also runs backward from the summed
next-token NLL and accumulates, per layer and KV head, ``gk = Σ_t g_t g_tᵀ`` with ``g_t = ∂(Σ NLL)/∂k_t`` (and
``gv`` for the values) — the empirical Fisher of the cached numbers. With ``Z = I − enc·decᵀ`` the per-token loss
increase of a basis is predicted (second order, residual independent of the gradient) as

    ``ΔNLL ≈ ½ · tr(Zᵀ G_K Z G_F)``  with per-token ``G_K = kk/N``, ``G_F = gk/N_g``,

which is the attention-aware objective of :func:`kvsplice.lowrank.fits.oblique_basis` with the gradient Gram in
place of the query Gram: keys and values, every layer and head, in one unit (nats per token) — what
:mod:`kvsplice.lowrank.allocate` spends a byte budget on, and what the ``fisher`` fit minimises.

Gradients are taken at the projections' outputs (``k_proj`` / ``v_proj`` of Llama-family attention, GPT-2's
``c_attn``), i.e. on pre-RoPE keys; post-RoPE gradients are the same vectors rotated at their positions (the rotation
is orthogonal: ``∂L/∂k_rot = R_t ∂L/∂k``). The statistics are saved and reused with :func:`save_stats` /
:func:`load_stats` (``fit_bases --calib-stats``, ``kvsplice.plan``).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from kvsplice.adapters import adapter_for, model_fingerprint
from kvsplice.adapters.base import apply_rope
from kvsplice.adapters.capture import resolve_rope
from kvsplice.lowrank.calibrate import CalibrationStats, _output_slices

__all__ = ["calibrate_all"]


def _gram(acc: torch.Tensor, x: torch.Tensor) -> None:
    """``acc (H, d, d) += Σ x xᵀ`` over ``x (B, H, T, d)``."""
    x = x.detach().to(torch.float64).transpose(0, 1).reshape(x.shape[1], -1, x.shape[-1])  # (H, B·T, d)
    acc += (x.transpose(1, 2) @ x).cpu()


def _joint(acc: torch.Tensor, x: torch.Tensor) -> None:
    """``acc (H·d, H·d) += Σ_t x_t x_tᵀ`` with ``x_t`` the heads of token t concatenated; ``x (B, H, T, d)``."""
    xt = x.detach().to(torch.float64).permute(0, 2, 1, 3).reshape(-1, x.shape[1] * x.shape[3])  # (B·T, H·d)
    acc += (xt.T @ xt).cpu()


def _kv_outputs(module: nn.Module, kv_width: int):
    """The submodules whose outputs are the keys and values: ``[(module, slice_k, slice_v)]``."""
    if hasattr(module, "k_proj") and hasattr(module, "v_proj"):  # Qwen3 / Gemma-3: the keys RoPE sees are k_norm's
        return [(getattr(module, "k_norm", None) or module.k_proj, "k", None), (module.v_proj, "v", None)]
    if hasattr(module, "c_attn"):  # GPT-2: q | k | v along the last dim
        return [(module.c_attn, "qkv", kv_width)]
    if hasattr(module, "qkv_proj"):  # Phi-3: q | k | v along the last dim
        return [(module.qkv_proj, "qkv", kv_width)]
    raise ValueError(f"loss sensitivities need k_proj / v_proj (Llama family), qkv_proj (Phi-3) or c_attn (GPT-2) "
                     f"attention, got "
                     f"{type(module).__name__}")


def calibrate_all(model: nn.Module, batches: Sequence[torch.Tensor], *, ropes: Iterable[str] = ("pre", "post"),
                  joint: bool = True, sensitivity: bool = True, grad_batches: Optional[int] = None,
                  progress: bool = True) -> dict[str, CalibrationStats]:
    """RoPE mode → :class:`~kvsplice.lowrank.calibrate.CalibrationStats` of one pass over ``batches`` (LongTensors
    ``(B, T)``). ``ropes``: the modes to record (``"none"`` for models without RoPE, whatever is asked);
    ``joint``: also the layer-joint Grams; ``sensitivity``: also the loss-gradient Grams, on the first
    ``grad_batches`` batches (default all; the others run forward only)."""
    adapter = adapter_for(model)
    adapter.require_projections()
    info = adapter.info()
    modes = sorted({resolve_rope(info, r) for r in ropes})
    fp = model_fingerprint(model)
    wo = _output_slices(adapter)
    sets = {m: CalibrationStats.zeros(info, m, wo, fp) for m in modes}
    L, hkv, d = info.n_layer, info.n_kv_head, info.head_dim
    g = info.group_size
    for s in sets.values():
        if joint:
            s.kk_joint = torch.zeros(L, hkv * d, hkv * d, dtype=torch.float64)
            s.vv_joint = torch.zeros_like(s.kk_joint)
        if sensitivity:
            s.gk, s.gv = torch.zeros_like(s.kk), torch.zeros_like(s.vv)
            s.gk_joint, s.gv_joint = torch.zeros_like(s.kk_joint), torch.zeros_like(s.kk_joint)

    def sink_for(s: CalibrationStats):
        def sink(layer: int, kind: str, x: torch.Tensor) -> None:
            if kind == "k":
                _gram(s.kk[layer], x)
                if joint:
                    _joint(s.kk_joint[layer], x)
            elif kind == "v":
                _gram(s.vv[layer], x)
                if joint:
                    _joint(s.vv_joint[layer], x)
            else:
                _gram(s.qq[layer], x)
                b, _, n, _ = x.shape  # (B, Hq, T, d): the query heads of a KV head are contiguous
                _gram(s.qsum[layer], x.reshape(b, hkv, g, n, d).sum(2) if g > 1 else x)
        return sink

    grads: list[tuple[int, str, torch.Tensor]] = []  # filled by the tensor hooks during backward

    def on_output(layer: int, kind: str, width: Optional[int]):
        def hook(mod, inp, out):
            if out.requires_grad:
                out.register_hook(lambda gr: grads.append((layer, kind, gr.detach())))
        return hook

    def accumulate(t: int, device) -> None:
        rope = adapter.rope(torch.zeros(1, t, d, device=device), 0, t) if info.has_rope else None  # (1, T, d)
        for layer, kind, gr in grads:
            gr = gr.reshape(gr.shape[0], t, -1)  # (B, T, width): k_norm's output is (B, T, Hkv, d)
            parts = {"k": gr} if kind == "k" else {"v": gr} if kind == "v" else \
                dict(zip("kv", gr[..., info.n_head * d:].split(hkv * d, dim=-1)))  # GPT-2 / Phi-3: drop q, split k | v
            for name, x in parts.items():
                x = x.reshape(*x.shape[:-1], hkv, d).transpose(1, 2)  # (B, Hkv, T, d)
                for mode, s in sets.items():
                    rot = name == "k" and mode == "post"  # ∂L/∂k_rot = R_t ∂L/∂k, with the layer's own tables
                    y = apply_rope(x, *adapter.layer_rope(layer, rope)) if rot else x
                    _gram((s.gk if name == "k" else s.gv)[layer], y)
                    _joint((s.gk_joint if name == "k" else s.gv_joint)[layer], y)
        grads.clear()

    handles = [h for m, s in sets.items() for h in adapter.attach_qkv_hooks(sink_for(s), m)]
    if sensitivity:
        for layer in range(L):
            for mod, kind, width in _kv_outputs(adapter.attention_module(layer), hkv * d):
                handles.append(mod.register_forward_hook(on_output(layer, kind, width)))
    device = next(model.parameters()).device
    was_training = model.training
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    if sensitivity:  # gradients of the activations only: weights frozen, the embeddings' output is the graph's leaf
        if not hasattr(model, "get_input_embeddings"):
            raise ValueError("loss sensitivities need a transformers model (get_input_embeddings)")
        for p, _ in frozen:
            p.requires_grad_(False)
        handles.append(model.get_input_embeddings().register_forward_hook(
            lambda mod, inp, out: out.detach().requires_grad_(torch.is_grad_enabled())))
    model.eval()
    n_tokens = n_grad = 0
    try:
        for i, batch in enumerate(tqdm(batches, desc=f"calibrate ({', '.join(modes)})", unit="batch",
                                       disable=not progress)):
            ids = torch.as_tensor(batch).to(device=device, dtype=torch.long)
            with_grad = sensitivity and (grad_batches is None or i < grad_batches)
            with torch.set_grad_enabled(with_grad):
                if not with_grad:
                    adapter.base_forward(ids)
                else:
                    out = model(input_ids=ids, use_cache=False) if hasattr(model, "config") else model(ids)
                    logits = out if isinstance(out, torch.Tensor) else out.logits  # (B, T, V)
                    # (B·(T-1), V) logits vs (B·(T-1),) next tokens, summed: g_t = ∂(Σ NLL)/∂k_t
                    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                           ids[:, 1:].reshape(-1), reduction="sum")
                    loss.backward()
                    accumulate(ids.shape[1], device)
                    n_grad += ids.numel()
            n_tokens += ids.numel()
    finally:
        for h in handles:
            h.remove()
        for p, req in frozen:
            p.requires_grad_(req)
        model.train(was_training)
        grads.clear()
    for s in sets.values():
        s.n_tokens, s.n_grad_tokens = n_tokens, n_grad
    return sets


def stats_for(model: nn.Module, batches_fn, *, path=None, ropes: Iterable[str] = ("pre", "post"),
              sensitivity: bool = True, joint: bool = True, grad_batches: Optional[int] = None,
              source: Optional[dict] = None, progress: bool = True, replace: bool = True
              ) -> tuple[dict[str, CalibrationStats], bool]:
    """Calibration statistics for ``model``, reused from ``path`` when it holds them for this model (fingerprint),
    every mode of ``ropes`` and — if asked — the sensitivities; otherwise one :func:`calibrate_all` pass over
    ``batches_fn()`` (called only then), saved to ``path`` (atomically; an existing file that lacks something is
    replaced only with ``replace``). ``source`` (the text, tokens, windows) is
    recorded in the stats' metadata. Returns ``(stats per mode, reused)``."""
    from pathlib import Path

    from kvsplice.adapters import model_info
    from kvsplice.lowrank.calibrate import load_stats, save_stats
    from models.checkpoint import atomic_write

    info = model_info(model)
    want = {resolve_rope(info, r) for r in ropes}
    fp = model_fingerprint(model)
    if path is not None and Path(path).is_file():
        sets = load_stats(path)
        fps = {s.fingerprint for s in sets.values()}
        if fps != {fp}:
            raise ValueError(f"{path} holds calibration stats of another model ({sorted(map(str, fps))}, not {fp})")
        if want <= set(sets) and (not sensitivity or all(sets[m].has_sensitivity for m in want)):
            return {m: sets[m] for m in sorted(want)}, True
        if not replace:
            lack = sorted(want - set(sets)) or ["loss sensitivities"]
            raise ValueError(f"{path} holds calibration stats without {', '.join(lack)}; pass another file, or --force "
                             f"to recompute it")
    sets = calibrate_all(model, batches_fn(), ropes=sorted(want), joint=joint, sensitivity=sensitivity,
                         grad_batches=grad_batches, progress=progress)
    for s in sets.values():
        s.meta.update(source or {})
    if path is not None:
        atomic_write(Path(path), lambda p: save_stats(p, sets))
    return sets, False

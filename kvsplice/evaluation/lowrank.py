"""Measurements of saved low-rank bases on held-out text (``kvsplice eval-bases --method static``):
perplexity full vs compressed cache, per-layer score / key / value errors, attention-output error, Lesens' gap,
measured cache bytes, and the attention-error diagnostics. The CLI module documents every number."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from kvsplice.adapters import apply_rope
from kvsplice.evaluation.context import EvalContext, EvalError
from kvsplice.evaluation.options import EvalBasesOptions
from kvsplice.lowrank.bases import KVBases
from kvsplice.lowrank.diagnostics import bases_diagnostics
from kvsplice.lowrank.fit_errors import bases_errors, lesens_terms
from kvsplice.decode import Decoder, DenseKV
from kvsplice.lowrank.method import LowRank
from kvsplice.core.attention import dense_attend
from kvsplice.core.window import window_mask

__all__ = ["attention_output_errors", "eval_static", "evaluate_bases", "evaluate_quantised", "bases_layer_errors"]


def _agg(rel: list[float], den: list[float]) -> float:
    """Layer-level relative error from per-head relative errors and their squared norms."""
    tot = sum(den)
    return math.sqrt(sum(r * r * d for r, d in zip(rel, den)) / tot) if tot > 0 else 0.0


def bases_layer_errors(stats, bases: KVBases) -> dict[str, Any]:
    """Per layer (aggregated over KV heads) and per head: score/key/value errors of ``bases`` and Lesens' terms at
    each head's key rank, all on the Grams in ``stats``."""
    per_head = bases_errors(stats, bases)
    layers = []
    for l in range(stats.n_layer):
        dens: dict[str, list[float]] = {k: [] for k in ("scores", "scores_sum", "keys", "values", "values_plain")}
        lt, lt_sum = [], []
        for j in range(stats.n_kv_head):
            kk, vv = stats.key_gram(l, j, True), stats.value_gram(l, j, True)
            qc, qs = stats.query_gram(l, j, "concat", True), stats.query_gram(l, j, "sum", True)
            wg = stats.output_gram(l, j)
            dens["scores"].append(float(torch.trace(kk @ qc)))
            dens["scores_sum"].append(float(torch.trace(kk @ qs)))
            dens["keys"].append(float(torch.trace(kk)))
            dens["values"].append(float(torch.trace(vv @ wg)))
            dens["values_plain"].append(float(torch.trace(vv)))
            r = bases.layers[l][j].rank_k
            lt.append(lesens_terms(kk, qc, r))
            lt_sum.append(lesens_terms(kk, qs, r))
        row = {k: _agg(per_head[k][l], dens[k]) for k in dens}

        def les(terms):
            tot = sum(t["total"] for t in terms)
            f = (lambda key: sum(t[key] for t in terms) / tot) if tot > 0 else (lambda key: 0.0)
            return {"gap_rel": f("gap"), "konly_opt_err": math.sqrt(f("err_konly")),
                    "kq_opt_err": math.sqrt(f("err_kq")),
                    "gap_rel_per_head": [t["gap"] / t["total"] if t["total"] > 0 else 0.0 for t in terms]}

        row["lesens"] = les(lt)
        row["lesens_sum"] = les(lt_sum)
        layers.append(row)
    return {"layers": layers, "per_head": per_head}


@torch.no_grad()
def attention_output_errors(ctx: EvalContext, bases: KVBases) -> list[float]:
    """Per layer ``‖Y − Ŷ‖_F / ‖Y‖_F`` of the attention output after ``W_O`` (bias excluded), exact q/k/v of the
    first ``ctx.err_windows`` windows vs the bases' ``k̂``/``v̂`` (see the module docstring)."""
    info = ctx.info
    mode = bases.rope if info.has_rope else "none"
    exact = ctx.qkv("post")  # rotated q, k as the model attends (== "none" for models without RoPE)
    proj = ctx.qkv("pre") if mode == "pre" else exact
    wo = ctx.stats("post").wo  # (L, Hq, d_model, d) float64
    dec = ctx.family()
    out = []
    for l in range(info.n_layer):
        q = exact[l]["q"].double()  # (B, Hq, T, d)
        k = exact[l]["k"].double()  # (B, Hkv, T, d)
        v = exact[l]["v"].double()
        kp = proj[l]["k"].double()
        heads = bases.layers[l]
        k_hat = torch.stack([kp[:, j] @ h.k_enc.double() @ h.k_dec.double().T for j, h in enumerate(heads)], 1)
        v_hat = torch.stack([v[:, j] @ h.v_enc.double() @ h.v_dec.double().T for j, h in enumerate(heads)], 1)
        if mode == "pre":
            cos, sin = dec.adapter.rope(k_hat.float(), 0, k.shape[2], layer=l)  # (1, T, d)
            k_hat = apply_rope(k_hat, cos.double(), sin.double())
        scale, w = dec.scales[l], dec.windows[l]
        mask = None if w is None else window_mask(0, k.shape[2], k.shape[2], w, k.device)  # a sliding window's
        o = dense_attend(q, k, v, scale=scale, mask=mask, backend="sdpa")  # (B, Hq, T, d)
        o_hat = dense_attend(q, k_hat, v_hat, scale=scale, mask=mask, backend="sdpa")
        w = wo[l].to(o.dtype)
        y = torch.einsum("bhtd,hmd->btm", o, w)
        y_hat = torch.einsum("bhtd,hmd->btm", o_hat, w)
        den = float(torch.linalg.vector_norm(y))
        out.append(float(torch.linalg.vector_norm(y - y_hat)) / den if den > 0 else 0.0)
    return out


def evaluate_bases(ctx: EvalContext, bases: KVBases, label: str = "bases", path: Optional[str] = None,
                   diagnostics: bool = True) -> dict[str, Any]:
    """Every measurement of the module docstring for one set of bases (checked against the model first);
    ``diagnostics=False``: perplexity and bytes only (no held-out Grams, no float64 attention-output errors)."""
    bases.check_model(ctx.fingerprint)
    decoder = Decoder(ctx.model, LowRank(bases))  # shape checks raise BasesMismatchError
    full = ctx.full()
    res = ctx.decode(decoder, desc=label)
    c = res["cache"]
    held = [c["held"]] * bases.n_layer if isinstance(c["held"], int) else c["held"]  # tokens per layer
    numbers = sum(sum(h.rank_k + h.rank_v for h in heads) * t for heads, t in zip(bases.layers, held))
    c["formula_bytes"] = numbers * c["batch_size"] * c["element_size"]
    c["full_kv_measured_bytes"] = full["cache"]["measured_live_bytes"] if (
        full["cache"]["batch_size"], full["cache"]["seq_len"]) == (c["batch_size"], c["seq_len"]) else None
    c["full_kv_formula_bytes"] = ctx.full_kv_formula(c["batch_size"], c["held"], c["element_size"])
    c["bytes_match"] = c["measured_live_bytes"] == c["formula_bytes"] == c.get("cache_bytes_formula") == c["nbytes"]
    c["compression"] = c["full_kv_formula_bytes"] / c["measured_live_bytes"]
    rope = bases.rope if ctx.info.has_rope else "none"
    if diagnostics:
        errs = bases_layer_errors(ctx.stats(rope), bases)
        for row, e in zip(errs["layers"], attention_output_errors(ctx, bases)):
            row["attn_out"] = e
    ranks = bases.ranks()
    flat_k = [r for layer in ranks["k"] for r in layer]
    flat_v = [r for layer in ranks["v"] for r in layer]
    res.update({
        "label": label, "bases_file": path, "method": bases.method, "rope": rope,
        "ranks_k": ranks["k"], "ranks_v": ranks["v"],
        "rank_k_mean": sum(flat_k) / len(flat_k), "rank_v_mean": sum(flat_v) / len(flat_v),
        "elements_per_token": bases.elements_per_token(),
        "ppl_ratio": res["ppl"] / full["ppl"],
        "calibration_tokens": bases.meta.get("calibration_tokens"),
        "calibration_source": bases.meta.get("calibration_source"),
        "decode_over_forward": res["decode_s"] / full["forward_s"] if full.get("forward_s") else None,
    })
    if diagnostics:
        res.update({"layers": errs["layers"], "per_head": errs["per_head"]})
    return res


def evaluate_quantised(ctx: EvalContext, bases: Optional[KVBases], quant: str, unquantised: dict[str, Any],
                       label: str) -> dict[str, Any]:
    """Perplexity and measured bytes with the cache of ``unquantised``'s decoder stored as ``quant`` (int8 rows +
    fp16 scales): the same bases (``None``: the full K/V cache), the same windows."""
    decoder = Decoder(ctx.model, DenseKV(cache_quant=quant) if bases is None else LowRank(bases, cache_quant=quant))
    res = ctx.decode(decoder, desc=label)
    c = res["cache"]
    full = ctx.full()
    c["formula_bytes"] = c["cache_bytes_formula"]  # the method's: full K/V or coefficients, int8 rows + scales
    c["bytes_match"] = c["measured_live_bytes"] == c["formula_bytes"] == c["nbytes"]
    c["full_kv_formula_bytes"] = ctx.full_kv_formula(c["batch_size"], c["held"], c["element_size"])
    c["compression"] = c["full_kv_formula_bytes"] / c["measured_live_bytes"]
    res.update({k: unquantised[k] for k in ("method", "rope", "ranks_k", "ranks_v", "elements_per_token")
                if k in unquantised})
    res.update({"label": label, "cache_quant": quant, "ppl_ratio": res["ppl"] / full["ppl"],
                "ppl_change_from_quant": res["ppl"] / unquantised["ppl"] - 1.0})
    return res


def eval_static(ctx: EvalContext, opts: EvalBasesOptions) -> list[dict[str, Any]]:
    """``--method static``: each ``--bases`` file, with :func:`~kvsplice.lowrank.diagnostics.bases_diagnostics`."""
    if not opts.bases:
        raise EvalError("--bases FILE is required (saved bases from kvsplice fit-bases)")
    out = []
    for path in opts.bases:
        bases = KVBases.load(path)  # FileNotFoundError / BasesMismatchError with one-line messages
        src = bases.meta.get("calibration_source")
        if src and Path(src).exists() and Path(opts.data).exists() and \
                Path(src).resolve() == Path(opts.data).resolve():
            print(f"eval_bases: warning: {path} was calibrated on {src}, the same text as --data "
                  f"(not held out)", file=sys.stderr)
        diag = opts.diagnostics
        res = evaluate_bases(ctx, bases, label=Path(path).stem, path=str(path), diagnostics=diag)
        if diag:
            res["diagnostics"] = bases_diagnostics(ctx.model, bases, ctx.windows[: ctx.err_windows])
        out.append(res)
        if opts.cache_quant:
            out.append(evaluate_quantised(ctx, bases, opts.cache_quant, res, f"{res['label']}+{opts.cache_quant}"))
    if opts.cache_quant:  # the full K/V cache quantised alone, for reference
        full = dict(ctx.full(), method="—", rope="—", ranks_k=[["—"]], ranks_v=[["—"]],
                    elements_per_token=ctx.full()["elements_per_token"])
        out.append(evaluate_quantised(ctx, None, opts.cache_quant, full, f"full K/V+{opts.cache_quant}"))
    return out


"""Evaluation of low-rank bases on held-out text (``python -m kvsplice.eval_bases``): the shared
:class:`EvalContext` (windows decoded through any decoder, full-cache reference, held-out Grams and exact q/k/v)
and the measurements of saved bases — perplexity full vs compressed, per-layer score / key / value errors,
attention-output error, Lesens' gap, measured cache bytes. The CLI module documents every number."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kvsplice.adapters import apply_rope, model_fingerprint, model_info
from kvsplice.decode import Decoder, DenseKV
from kvsplice.lowrank.bases import KVBases
from kvsplice.lowrank.calibrate import calibrate, extract_qkv
from kvsplice.lowrank.fits import bases_errors, lesens_terms
from kvsplice.lowrank.method import CoefficientDecoder
from kvsplice.online.diagnostics import bases_diagnostics
from kvsplice.report.memory import measure_cache
from models.attention import attend

__all__ = ["EvalContext", "EvalError", "attention_output_errors", "eval_static", "evaluate_bases", "layer_errors",
           "load_windows"]


class EvalError(RuntimeError):
    """A one-line error of the eval CLI."""


class EvalContext:
    """The model, the held-out windows and lazily computed, shared measurements (full-cache perplexity, held-out
    Grams and exact q/k/v per RoPE mode) for evaluating one or more compressed caches."""

    def __init__(self, loaded, windows: torch.Tensor, *, batch_size: int = 8, chunk_size: int = 64,
                 err_windows: int = 2, progress: bool = False, data_info: Optional[dict] = None) -> None:
        self.loaded, self.model = loaded, loaded.model
        self.info = model_info(self.model)
        self.fingerprint = model_fingerprint(self.model)
        self.windows = windows  # (N, T)
        self.batch_size, self.chunk_size = batch_size, chunk_size
        self.err_windows = max(1, min(err_windows, windows.shape[0]))
        self.progress = progress
        self.data_info = data_info or {}
        self._stats: dict[str, Any] = {}
        self._qkv: dict[str, Any] = {}
        self._full: Optional[dict] = None
        self._full_decoder = None

    # ------------------------------------------------------------------------------------------- decoding
    @torch.no_grad()
    def decode(self, decoder, desc: str = "decode") -> dict[str, Any]:
        """Summed NLL of every window through fresh caches of ``decoder`` (chunks of ``chunk_size``), the
        perplexity, and the first batch's cache measured after its last token."""
        n_win, t = self.windows.shape
        total, n_pred, measured = 0.0, 0, None
        t0 = time.perf_counter()
        batches = self.windows.split(self.batch_size)
        for bi, ids in enumerate(tqdm(batches, desc=desc, unit="batch", disable=not self.progress, leave=False)):
            cache = decoder.new_cache(ids.shape[0], capacity=t)
            for s in range(0, t, self.chunk_size):
                logits = decoder(ids[:, s:s + self.chunk_size], cache).float()
                tgt = ids[:, s + 1:s + self.chunk_size + 1]
                logits = logits[:, :tgt.shape[1]]
                if tgt.numel():
                    total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                             reduction="sum").item()
            n_pred += ids.shape[0] * (t - 1)
            if bi == 0:
                m = measure_cache(cache)
                measured = {"batch_size": ids.shape[0], "seq_len": cache.seq_len, "dtype": str(cache.dtype)
                            .replace("torch.", ""), "element_size": torch.empty((), dtype=cache.dtype).element_size(),
                            "measured_live_bytes": m.live_bytes, "measured_storage_bytes": m.storage_bytes,
                            "nbytes": cache.nbytes(), "n_tensors": m.n_tensors, "kind": type(cache).__name__}
                if hasattr(cache, "bytes_formula"):
                    measured["cache_bytes_formula"] = cache.bytes_formula()
        nll = total / max(n_pred, 1)
        return {"nll_per_token": nll, "ppl": math.exp(nll), "predicted_tokens": n_pred,
                "decode_s": time.perf_counter() - t0, "cache": measured}

    def full_kv_formula(self, batch_size: int, seq_len: int, element_size: int) -> int:
        i = self.info
        return 2 * i.n_layer * i.n_kv_head * i.head_dim * seq_len * batch_size * element_size

    def full(self) -> dict[str, Any]:
        """Perplexity with the full K/V cache (``Decoder(model, DenseKV())``), the model's own forward perplexity,
        and the full cache's bytes — computed once."""
        if self._full is None:
            res = self.decode(self.family(), desc="full cache")
            c = res["cache"]
            c["formula_bytes"] = self.full_kv_formula(c["batch_size"], c["seq_len"], c["element_size"])
            c["bytes_match"] = c["measured_live_bytes"] == c["formula_bytes"] == c["nbytes"]
            res["model_forward_ppl"] = self._forward_ppl()
            res["elements_per_token"] = 2 * self.info.n_layer * self.info.n_kv_head * self.info.head_dim
            self._full = res
        return self._full

    @torch.no_grad()
    def _forward_ppl(self) -> float:
        total, n = 0.0, 0
        for ids in self.windows.split(self.batch_size):
            out = self.model(input_ids=ids, use_cache=False) if hasattr(self.model, "config") else self.model(ids)
            logits = (out if isinstance(out, torch.Tensor) else out.logits).float()
            total += F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                     reduction="sum").item()
            n += ids.shape[0] * (ids.shape[1] - 1)
        return math.exp(total / max(n, 1))

    # ------------------------------------------------------------------------------------------- held-out stats
    def rope_arg(self, rope: str) -> Optional[str]:
        return rope if self.info.has_rope and rope in ("post", "pre") else None

    def stats(self, rope: str):
        """Held-out Grams (all windows) in RoPE mode ``rope``."""
        key = self.rope_arg(rope) or "none"
        if key not in self._stats:
            self._stats[key] = calibrate(self.model, list(self.windows.split(self.batch_size)),
                                         rope=self.rope_arg(rope), progress=False)
        return self._stats[key]

    def qkv(self, rope: str) -> list[dict[str, torch.Tensor]]:
        """Exact q/k/v of the first ``err_windows`` windows in RoPE mode ``rope``."""
        key = self.rope_arg(rope) or "none"
        if key not in self._qkv:
            self._qkv[key] = extract_qkv(self.model, self.windows[: self.err_windows], rope=self.rope_arg(rope))
        return self._qkv[key]

    def family(self) -> Decoder:
        """The full-cache reference decoder (its adapter and scales serve every measurement)."""
        if self._full_decoder is None:
            self._full_decoder = Decoder(self.model, DenseKV())
        return self._full_decoder


def load_windows(loaded, spec: str, n_tokens: int, seq_len: int, progress: bool = False
                 ) -> tuple[torch.Tensor, dict[str, Any]]:
    from kvsplice.io.loading import iter_texts, token_stream

    ids, n_stories = token_stream(iter_texts(spec, option="data", split="validation"), loaded.tokenizer, n_tokens,
                                  progress=progress, desc="tokenize data")
    n = ids.numel() // seq_len
    if n < 1:
        raise EvalError(f"--data {spec}: only {ids.numel()} tokens, fewer than --seq-len {seq_len}")
    windows = ids[: n * seq_len].view(n, seq_len)
    info = {"source": str(spec), "tokens": n * seq_len, "windows": n, "seq_len": seq_len, "stories": n_stories}
    if n * seq_len < n_tokens:
        info["note"] = f"asked for {n_tokens} tokens, used {n * seq_len} ({n} full windows of {seq_len})"
    return windows, info


def _agg(rel: list[float], den: list[float]) -> float:
    """Layer-level relative error from per-head relative errors and their squared norms."""
    tot = sum(den)
    return math.sqrt(sum(r * r * d for r, d in zip(rel, den)) / tot) if tot > 0 else 0.0


def layer_errors(stats, bases: KVBases) -> dict[str, Any]:
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
            cos, sin = dec.adapter.rope(k_hat.float(), 0, k.shape[2])  # (1, T, d)
            k_hat = apply_rope(k_hat, cos.double(), sin.double())
        scale = dec.scales[l]
        o = attend(q, k, v, scale=scale, backend="sdpa")  # (B, Hq, T, d)
        o_hat = attend(q, k_hat, v_hat, scale=scale, backend="sdpa")
        w = wo[l].to(o.dtype)
        y = torch.einsum("bhtd,hmd->btm", o, w)
        y_hat = torch.einsum("bhtd,hmd->btm", o_hat, w)
        den = float(torch.linalg.vector_norm(y))
        out.append(float(torch.linalg.vector_norm(y - y_hat)) / den if den > 0 else 0.0)
    return out


def evaluate_bases(ctx: EvalContext, bases: KVBases, label: str = "bases", path: Optional[str] = None
                   ) -> dict[str, Any]:
    """Every measurement of the module docstring for one set of bases (checked against the model first)."""
    bases.check_model(ctx.fingerprint)
    decoder = CoefficientDecoder(ctx.model, bases)  # shape checks raise BasesMismatchError
    full = ctx.full()
    res = ctx.decode(decoder, desc=label)
    c = res["cache"]
    c["formula_bytes"] = bases.elements_per_token() * c["seq_len"] * c["batch_size"] * c["element_size"]
    c["full_kv_measured_bytes"] = full["cache"]["measured_live_bytes"] if (
        full["cache"]["batch_size"], full["cache"]["seq_len"]) == (c["batch_size"], c["seq_len"]) else None
    c["full_kv_formula_bytes"] = ctx.full_kv_formula(c["batch_size"], c["seq_len"], c["element_size"])
    c["bytes_match"] = c["measured_live_bytes"] == c["formula_bytes"] == c.get("cache_bytes_formula") == c["nbytes"]
    c["compression"] = c["full_kv_formula_bytes"] / c["measured_live_bytes"]
    rope = bases.rope if ctx.info.has_rope else "none"
    errs = layer_errors(ctx.stats(rope), bases)
    attn = attention_output_errors(ctx, bases)
    for row, e in zip(errs["layers"], attn):
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
        "layers": errs["layers"], "per_head": errs["per_head"],
    })
    return res


def eval_static(ctx: EvalContext, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--method static``: each ``--bases`` file, with :func:`~kvsplice.online.diagnostics.bases_diagnostics`."""
    if not args.bases:
        raise EvalError("--bases FILE is required (saved bases from python -m kvsplice.fit_bases)")
    out = []
    for path in args.bases:
        bases = KVBases.load(path)  # FileNotFoundError / BasesMismatchError with one-line messages
        src = bases.meta.get("calibration_source")
        if src and Path(src).exists() and Path(args.data).exists() and \
                Path(src).resolve() == Path(args.data).resolve():
            print(f"eval_bases: warning: {path} was calibrated on {src}, the same text as --data "
                  f"(not held out)", file=sys.stderr)
        res = evaluate_bases(ctx, bases, label=Path(path).stem, path=str(path))
        res["diagnostics"] = bases_diagnostics(ctx.model, bases, ctx.windows[: ctx.err_windows])
        out.append(res)
    return out

"""Evaluate post-training KV bases on held-out text: perplexity with the full vs the compressed cache, per-layer
attention-score / output errors, Lesens' gap, and the cache's measured bytes.

    python -m kvsplice.eval_bases --model DIR|HUB_ID|CKPT --bases FILE.safetensors [FILE2 ...] --data PATH \\
        [--tokens N] [--seq-len T] [--batch-size B] [--chunk-size C] [--json REPORT.json]

What is measured (``--data`` must be held-out text, not the calibration text; a warning is printed otherwise):

* **Perplexity.** The text is tokenised story by story (BOS/EOS between stories, as the tokenizer does), cut to
  ``--tokens`` and into ``--seq-len`` windows (default: the model's context, <= 1024). Each window is fed through a
  fresh cache of a :class:`~kvsplice.lowrank.apply.CoefficientDecoder` in chunks of ``--chunk-size`` tokens (default 64;
  ``1`` = token by token): every chunk is appended to the cache first and its queries attend over the *cached*
  representation, so with bases every token (the first chunk included) attends over compressed keys and values.
  The chunk size changes only speed, not the numbers (up to float rounding). The full-cache reference is the same
  driver with ``bases=None`` (a plain K/V cache); the model's own forward perplexity is printed as a sanity check.
  Perplexity = ``exp(Σ NLL / #predicted)`` over all windows (``T − 1`` predictions per window).
* **Per-layer errors on the held-out text**, from Grams of its keys/queries/values (:func:`kvsplice.lowrank.calibrate
  .calibrate` in the bases' RoPE mode; :func:`kvsplice.lowrank.fits.bases_errors`), aggregated over a layer's KV heads as
  ``sqrt(Σ_j num_j / Σ_j den_j)``: attention-score error ``‖KQᵀ − K A Bᵀ Qᵀ‖/‖KQᵀ‖`` (queries of each group
  concatenated; also the group-summed form), key reconstruction error, value error through ``W_O``
  ``‖V W_Oᵀ − V̂ W_Oᵀ‖/‖V W_Oᵀ‖``.
* **Attention-output error**, measured directly on the first ``--err-windows`` windows: per layer, the exact
  ``q, k, v`` of the model (:func:`kvsplice.lowrank.calibrate.extract_qkv`, teacher-forced: no error propagation between
  layers) vs ``k̂ = k k_enc k_decᵀ`` (pre-RoPE: rebuilt before RoPE, then rotated) and ``v̂ = v v_enc v_decᵀ``;
  causal attention, then ``W_O``: ``‖Y − Ŷ‖_F/‖Y‖_F``.
* **Lesens' gap** at each head's key rank on the held-out Grams: ``ε = err_K-only − err_KQᵀ ≥ 0`` relative to
  ``‖KQᵀ‖²``, with the two errors (oracle fits on this text: what K-only SVD gives up vs the attention-aware optimum).
* **Cache bytes** of the first batch's cache after decoding: measured from its tensors
  (:func:`kvsplice.report.memory.measure_cache`), vs the formula ``Σ_layers Σ_heads (R_k + R_v) · T · B · bytes``, vs the
  full K/V cache of the same batch at the same dtype (measured, and ``2·L·H_kv·d·T·B·bytes``).

Bases fitted for another model fail with one line (:class:`kvsplice.lowrank.bases.BasesMismatchError`), exit status 1.

Methods: ``--method`` selects an evaluator from :data:`EVALUATORS` (``static``: saved bases files, the default).
New methods register ``EVALUATORS[name] = fn(ctx: EvalContext, args) -> list[dict]`` (and may add their own
options through :data:`METHOD_OPTIONS`); :meth:`EvalContext.decode` works with any decoder that has
``new_cache(batch_size, capacity=)`` and ``decoder(ids, cache) -> logits``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from kvsplice.lowrank.bases import BasesMismatchError, KVBases

__all__ = ["EVALUATORS", "METHOD_OPTIONS", "EvalContext", "attention_output_errors", "build_parser",
           "evaluate_bases", "layer_errors", "main", "print_results"]

PROG = "python -m kvsplice.eval_bases"


class EvalError(RuntimeError):
    """A one-line error of the eval CLI."""


# ================================================================================================ context
class EvalContext:
    """The model, the held-out windows and lazily computed, shared measurements (full-cache perplexity, held-out
    Grams and exact q/k/v per RoPE mode) for evaluating one or more compressed caches."""

    def __init__(self, loaded, windows: torch.Tensor, *, batch_size: int = 8, chunk_size: int = 64,
                 err_windows: int = 2, progress: bool = False, data_info: Optional[dict] = None) -> None:
        from kvsplice.lowrank.calibrate import model_fingerprint, model_info

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
        from tqdm.auto import tqdm

        from kvsplice.report.memory import measure_cache

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
        """Perplexity with the full K/V cache (``CoefficientDecoder(model, None)``), the model's own forward
        perplexity, and the full cache's bytes — computed once."""
        if self._full is None:
            from kvsplice.lowrank.apply import CoefficientDecoder

            self._full_decoder = CoefficientDecoder(self.model, None)
            res = self.decode(self._full_decoder, desc="full cache")
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
        from kvsplice.lowrank.calibrate import calibrate

        key = self.rope_arg(rope) or "none"
        if key not in self._stats:
            self._stats[key] = calibrate(self.model, list(self.windows.split(self.batch_size)),
                                         rope=self.rope_arg(rope), progress=False)
        return self._stats[key]

    def qkv(self, rope: str) -> list[dict[str, torch.Tensor]]:
        """Exact q/k/v of the first ``err_windows`` windows in RoPE mode ``rope``."""
        from kvsplice.lowrank.calibrate import extract_qkv

        key = self.rope_arg(rope) or "none"
        if key not in self._qkv:
            self._qkv[key] = extract_qkv(self.model, self.windows[: self.err_windows], rope=self.rope_arg(rope))
        return self._qkv[key]

    def family(self):
        from kvsplice.lowrank.apply import CoefficientDecoder

        if self._full_decoder is None:
            self._full_decoder = CoefficientDecoder(self.model, None)
        return self._full_decoder


# ================================================================================================ measurements
def _agg(rel: list[float], den: list[float]) -> float:
    """Layer-level relative error from per-head relative errors and their squared norms."""
    tot = sum(den)
    return math.sqrt(sum(r * r * d for r, d in zip(rel, den)) / tot) if tot > 0 else 0.0


def layer_errors(stats, bases: KVBases) -> dict[str, Any]:
    """Per layer (aggregated over KV heads) and per head: score/key/value errors of ``bases`` and Lesens' terms at
    each head's key rank, all on the Grams in ``stats``."""
    from kvsplice.lowrank.fits import bases_errors, lesens_terms

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
    from models.attention import attend

    info = ctx.info
    mode = bases.rope if info.has_rope else "none"
    exact = ctx.qkv("post")  # rotated q, k as the model attends (== "none" for models without RoPE)
    proj = ctx.qkv("pre") if mode == "pre" else exact
    wo = ctx.stats("post").wo  # (L, Hq, d_model, d) float64
    dec = ctx.family()
    fam = dec.fam
    out = []
    for l in range(info.n_layer):
        q = exact[l]["q"].double().transpose(1, 2)  # (B, Hq, T, d)
        k = exact[l]["k"].double().transpose(1, 2)  # (B, Hkv, T, d)
        v = exact[l]["v"].double().transpose(1, 2)
        kp = proj[l]["k"].double().transpose(1, 2)
        heads = bases.layers[l]
        k_hat = torch.stack([kp[:, j] @ h.k_enc.double() @ h.k_dec.double().T for j, h in enumerate(heads)], 1)
        v_hat = torch.stack([v[:, j] @ h.v_enc.double() @ h.v_dec.double().T for j, h in enumerate(heads)], 1)
        if mode == "pre":
            pos = torch.arange(k.shape[2])
            cos, sin = fam.rope_tables(k_hat.float(), pos)
            k_hat = fam.rotate(k_hat, cos.double(), sin.double())
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
    from kvsplice.lowrank.apply import CoefficientDecoder

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


# ================================================================================================ evaluators
def _eval_static(ctx: EvalContext, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--method static``: each ``--bases`` file."""
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
        out.append(evaluate_bases(ctx, bases, label=Path(path).stem, path=str(path)))
    return out


Evaluator = Callable[[EvalContext, argparse.Namespace], list]
EVALUATORS: dict[str, Evaluator] = {"static": _eval_static}
"""Method name → evaluator. ``static``: saved bases files (``--bases``)."""
METHOD_OPTIONS: dict[str, Callable[[argparse.ArgumentParser], None]] = {}
"""Method name → a function adding that method's options to the parser."""


# ---------------------------------------------------------------------- BEGIN fd-online + §3.5 diagnostics (issue 6)
# ``--method fd-online``: online frequent-directions bases per chunk (kvsplice.online.decoder.OnlineDecoder over a
# kvsplice.online.chunked.ChunkedCache; no calibration, no --bases). For every method, each result also gets per-layer
# error diagnostics vs the §3.5 bounds on the first --err-windows windows, teacher-forced (exact q/k/v of the model):
# kvsplice.online.decoder.bases_diagnostics (saved bases) / online_qkv_diagnostics (fd-online); printed by print_diagnostics.
# With --max-chunks (merges re-project old tokens) use --chunk-size 1 for true online semantics; without merges the
# result does not depend on the chunk size.
def _add_fd_online_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--method fd-online (online FD bases per chunk, no calibration; kvsplice.online.decoder)")
    g.add_argument("--rank", type=_pos_int, default=4, help="key rank r_k per chunk (default 4)")
    g.add_argument("--rank-v", type=_pos_int, help="value rank r_v (default: --rank)")
    g.add_argument("--ell", type=_pos_int, help="FD sketch size ℓ (default 2·max rank)")
    g.add_argument("--tau-k", type=float, help="close the chunk when a key's residual norm exceeds τ_k (default: "
                   "no residual closes)")
    g.add_argument("--tau-v", type=float, help="the same for values (default: none)")
    g.add_argument("--relative", action="store_true", help="τ relative to ‖k‖ / ‖v‖ instead of absolute")
    g.add_argument("--max-chunk-len", type=_pos_int, default=256, help="max tokens per chunk L (default 256)")
    g.add_argument("--max-chunks", type=_pos_int, help="merge cap J_max (default: never merge)")
    g.add_argument("--min-chunk-len", type=_pos_int, default=1, help="no residual close below this length")
    g.add_argument("--warmup", type=int, default=16, help="warm-up tokens kept at full dimension (default 16)")
    g.add_argument("--fd-decay", type=float, default=1.0, help="forgetting factor γ of the sketches (default 1)")
    g.add_argument("--tau-percentile", type=float, metavar="P", help="set τ_k/τ_v to the P-th percentile "
                   "(0-100) of the per-token residuals on --tau-calib text, decoded with thresholds off (one "
                   "scalar each, pooled over layers; kvsplice.online.decoder.calibrate_thresholds)")
    g.add_argument("--tau-calib", metavar="PATH", help="calibration text for --tau-percentile (required with it; "
                   "never the --data text); --tokens and --seq-len as for --data")


def _fd_online_kw(args: argparse.Namespace) -> dict[str, Any]:
    return dict(rank_k=args.rank, rank_v=args.rank_v or args.rank, ell=args.ell, tau_k=args.tau_k,
                tau_v=args.tau_v, relative=args.relative, max_chunk_len=args.max_chunk_len,
                max_chunks=args.max_chunks, min_chunk_len=args.min_chunk_len, warmup=args.warmup,
                fd_decay=args.fd_decay)


def _check_tau_options(args: argparse.Namespace) -> None:
    p, calib = getattr(args, "tau_percentile", None), getattr(args, "tau_calib", None)
    if p is None:
        if calib is not None:
            raise EvalError("--tau-calib needs --tau-percentile P")
        return
    if calib is None:
        raise EvalError("--tau-percentile needs --tau-calib PATH (calibration text, not the --data text)")
    if not 0 <= p <= 100:
        raise EvalError(f"--tau-percentile must be in [0, 100], got {p}")
    if Path(calib).expanduser().resolve() == Path(args.data).expanduser().resolve():
        raise EvalError("--tau-calib must not be the --data text (calibrate τ on other text)")
    if args.tau_k is not None or args.tau_v is not None:
        raise EvalError("give either --tau-percentile or --tau-k / --tau-v, not both")


def _calibrate_tau(ctx: EvalContext, args: argparse.Namespace, kw: dict[str, Any]) -> dict[str, Any]:
    """``--tau-percentile``: τ_k/τ_v from :func:`kvsplice.online.decoder.calibrate_thresholds` on ``--tau-calib`` windows."""
    from kvsplice.io.loading import iter_texts, token_stream
    from kvsplice.online.decoder import calibrate_thresholds

    seq_len = ctx.windows.shape[1]
    ids, _ = token_stream(iter_texts(args.tau_calib, option="tau-calib", split="train"), ctx.loaded.tokenizer,
                          args.tokens, progress=ctx.progress, desc="tokenize tau-calib")
    n = ids.numel() // seq_len
    if n < 1:
        raise EvalError(f"--tau-calib {args.tau_calib}: only {ids.numel()} tokens, fewer than --seq-len {seq_len}")
    windows = ids[: n * seq_len].view(n, seq_len)
    cal = calibrate_thresholds(ctx.model, windows.split(ctx.batch_size), percentile=args.tau_percentile, **kw)
    cal["source"] = str(args.tau_calib)
    tv = "—" if cal["tau_v"] is None else f"{cal['tau_v']:.6g}"
    print(f"fd-online: τ from the {cal['percentile']:g}th percentile of {cal['n_residuals']:,} per-token "
          f"{'relative ' if kw['relative'] else ''}residuals ({cal['n_tokens']:,} tokens of {args.tau_calib}, "
          f"thresholds off): τ_k = {cal['tau_k']:.6g}, τ_v = {tv}")
    return cal


def _eval_fd_online(ctx: EvalContext, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--method fd-online``: perplexity through a :class:`ChunkedCache`, its bytes (coefficients + bases +
    sketches, split per sequence), chunk counts J and the diagnostics. With ``--tau-percentile`` τ_k/τ_v are first
    calibrated on ``--tau-calib`` (:func:`_calibrate_tau`)."""
    from kvsplice.online.decoder import OnlineDecoder, online_qkv_diagnostics

    info = ctx.info
    _check_tau_options(args)
    kw = _fd_online_kw(args)
    if max(kw["rank_k"], kw["rank_v"]) > info.head_dim:
        raise EvalError(f"--rank / --rank-v must be <= the model's head_dim {info.head_dim}")
    tau_cal = None
    if getattr(args, "tau_percentile", None) is not None:
        tau_cal = _calibrate_tau(ctx, args, kw)
        kw["tau_k"], kw["tau_v"] = tau_cal["tau_k"], tau_cal["tau_v"]
    dec = OnlineDecoder(ctx.model, **kw)
    full = ctx.full()
    res = ctx.decode(dec, desc="fd-online")
    c = res["cache"]
    c["formula_bytes"] = c["nbytes"]  # no closed form: chunk count depends on the data; nbytes = Σ tensors
    c["bytes_match"] = c["measured_live_bytes"] == c["nbytes"]
    c["full_kv_formula_bytes"] = ctx.full_kv_formula(c["batch_size"], c["seq_len"], c["element_size"])
    c["compression"] = c["full_kv_formula_bytes"] / c["measured_live_bytes"]
    one = dec.new_cache(1)  # one window again (the cache's final state does not depend on the call sizes)
    dec(ctx.windows[:1], one)
    c["per_sequence_breakdown"] = one.nbytes_breakdown()
    diag = online_qkv_diagnostics(ctx.model, ctx.windows[: ctx.err_windows], **kw)
    ranks_k = [[kw["rank_k"]] * info.n_kv_head for _ in range(info.n_layer)]
    ranks_v = [[kw["rank_v"]] * info.n_kv_head for _ in range(info.n_layer)]
    short = {"ell": "ℓ", "tau_k": "τk", "tau_v": "τv", "max_chunk_len": "L", "max_chunks": "Jmax",
             "min_chunk_len": "m", "warmup": "W", "fd_decay": "γ"}
    default = {"max_chunk_len": 256, "min_chunk_len": 1, "warmup": 16, "fd_decay": 1.0}
    label = f"fd-online r={kw['rank_k']}/{kw['rank_v']}" + "".join(
        f" {short[k]}={f'{v:.4g}' if isinstance(v, float) else v}" for k, v in kw.items() if k in short and v is not None and v != default.get(k)) + (
        " rel" if kw["relative"] else "")
    res.update({"label": label, "method": "fd-online", "rope": "post" if info.has_rope else "none",
                "config": kw, "ranks_k": ranks_k, "ranks_v": ranks_v,
                "elements_per_token": round(one.elements_per_token(), 2), "ppl_ratio": res["ppl"] / full["ppl"],
                "chunks": [one.num_chunks(l) for l in range(info.n_layer)], "diagnostics": diag})
    if tau_cal is not None:
        res["label"] += f" τ@p{tau_cal['percentile']:g}"
        res["tau_calibration"] = tau_cal
    return [res]


def _with_diagnostics(fn: Evaluator) -> Evaluator:
    """Wrap an evaluator of saved bases: attach :func:`kvsplice.online.decoder.bases_diagnostics` to each result."""

    def run(ctx: EvalContext, args: argparse.Namespace) -> list[dict[str, Any]]:
        from kvsplice.online.decoder import bases_diagnostics

        results = fn(ctx, args)
        for r in results:
            if "diagnostics" not in r and r.get("bases_file"):
                bases = KVBases.load(r["bases_file"])
                r["diagnostics"] = bases_diagnostics(ctx.model, bases, ctx.windows[: ctx.err_windows])
        return results

    run.__doc__ = fn.__doc__
    return run


def print_diagnostics(results: list[dict[str, Any]], console=None) -> None:
    """Per result with ``diagnostics``: a table of observed errors vs bounds per layer (max over queries/heads)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=max(Console().width, 132))
    cols = [("logit_err", "ε obs"), ("logit_bound", "ε ≤ s‖q‖maxρ"), ("softmax_l1", "‖Δα‖₁ obs"),
            ("softmax_bound", "2tanh(δ̄/4)"), ("softmax_bound_sinh", "2sinh(δ̄/2)"), ("output_err", "‖Δo‖ obs"),
            ("output_bound", "‖Δo‖ bound"), ("logit_slack", "slack ε"), ("softmax_slack", "slack α"),
            ("output_slack", "slack o"), ("holds", "holds"), ("chunks_max", "J")]
    for r in results:
        diag = r.get("diagnostics")
        if not diag:
            continue
        t = Table(title=f"{r['label']}: observed attention errors vs §3.5 bounds per layer (teacher-forced, "
                        f"max over queries/heads; slack = max bound / max observed)")
        use = [(k, h) for k, h in cols if k in diag[0]]
        t.add_column("layer", justify="right")
        for _, h in use:
            t.add_column(h, justify="right")
        for l, d in enumerate(diag):
            cells = []
            for k, _ in use:
                v = d[k]
                cells.append(("yes" if v else "NO") if isinstance(v, bool) else
                             str(v) if isinstance(v, int) else "inf" if v == math.inf else f"{v:.3g}")
            t.add_row(str(l), *cells)
        console.print(t)


EVALUATORS["static"] = _with_diagnostics(EVALUATORS["static"])
EVALUATORS["fd-online"] = _eval_fd_online
METHOD_OPTIONS["fd-online"] = _add_fd_online_options
# ------------------------------------------------------------------------ END fd-online + §3.5 diagnostics (issue 6)


# ================================================================================================ CLI
def _pos_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {s}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Evaluate post-training KV bases on held-out text: "
                                "perplexity full vs compressed cache, per-layer errors, Lesens' gap, cache bytes.")
    p.add_argument("--model", required=True, help="model directory, training .ckpt or Hugging Face Hub id "
                   "(the model the bases were fitted for)")
    p.add_argument("--tokenizer", help="override the model's tokenizer")
    p.add_argument("--method", choices=sorted(EVALUATORS), default="static", help="static: saved bases files "
                   "(default)")
    p.add_argument("--bases", nargs="+", help="bases .safetensors file(s) from python -m kvsplice.fit_bases")
    p.add_argument("--data", required=True, help="held-out text: .txt/.json/.jsonl file or folder, or a Hugging "
                   "Face dataset ID[:SPLIT] (default split: validation)")
    p.add_argument("--tokens", type=_pos_int, default=16384, help="evaluation tokens (default 16384)")
    p.add_argument("--seq-len", type=_pos_int, help="window length (default: the model's context, <= 1024)")
    p.add_argument("--batch-size", type=_pos_int, default=8, help="windows decoded together (default 8)")
    p.add_argument("--chunk-size", type=_pos_int, default=64, help="tokens appended to the cache per decoder call "
                   "(default 64; 1 = token by token; the result does not depend on it)")
    p.add_argument("--err-windows", type=_pos_int, default=2, help="windows for the direct attention-output "
                   "error (default 2)")
    p.add_argument("--json", help="write the full report (per-layer and per-head numbers) as JSON")
    p.add_argument("--threads", type=_pos_int, help="torch intra-op threads")
    p.add_argument("--no-progress", action="store_true")
    for add in METHOD_OPTIONS.values():
        add(p)
    return p


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


def make_context(args: argparse.Namespace, loaded=None) -> EvalContext:
    from kvsplice.fit_bases import default_seq_len
    from kvsplice.io.loading import load_model

    if loaded is None:
        loaded = load_model(args.model, tokenizer=getattr(args, "tokenizer", None))
    seq_len = args.seq_len or default_seq_len(loaded.max_positions)
    if loaded.max_positions is not None and seq_len > loaded.max_positions:
        raise EvalError(f"--seq-len {seq_len} exceeds the model's {loaded.max_positions} positions")
    progress = not getattr(args, "no_progress", False)
    windows, info = load_windows(loaded, args.data, args.tokens, seq_len, progress)
    return EvalContext(loaded, windows, batch_size=args.batch_size, chunk_size=args.chunk_size,
                       err_windows=getattr(args, "err_windows", 2), progress=progress, data_info=info)


def _fmt_ranks(ranks: list[list[int]]) -> str:
    flat = [r for layer in ranks for r in layer]
    return str(flat[0]) if len(set(flat)) == 1 else f"{min(flat)}–{max(flat)} (μ {sum(flat) / len(flat):.2f})"


def print_results(ctx: EvalContext, results: list[dict[str, Any]], console=None, per_layer: bool = True) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=max(Console().width, 132))
    full = ctx.full()
    d = ctx.data_info
    console.print(f"held-out text: {d.get('tokens', ctx.windows.numel()):,} tokens ({ctx.windows.shape[0]} windows × "
                  f"{ctx.windows.shape[1]}) from {d.get('source')}; decoded in chunks of {ctx.chunk_size} through "
                  f"the cache" + (f" — {d['note']}" if "note" in d else ""), soft_wrap=True)
    t = Table(title="perplexity and cache bytes (full K/V cache vs compressed coefficient cache)")
    for col in ("cache", "method", "rope", "R_k", "R_v", "numbers/token", "ppl", "ppl / full", "measured bytes",
                "= formula", "×smaller than full K/V"):
        t.add_column(col, justify="left" if col in ("cache", "method") else "right",
                     no_wrap=col in ("cache", "method"))
    fc = full["cache"]
    t.add_row("full K/V", "—", "—", "—", "—", str(full["elements_per_token"]), f"{full['ppl']:.4f}", "1",
              f"{fc['measured_live_bytes']:,}", "✓" if fc["bytes_match"] else f"≠ {fc['formula_bytes']:,}", "1")
    for r in results:
        c = r["cache"]
        t.add_row(r["label"], r["method"], r["rope"], _fmt_ranks(r["ranks_k"]), _fmt_ranks(r["ranks_v"]),
                  str(r["elements_per_token"]), f"{r['ppl']:.4f}", f"{r['ppl_ratio']:.4f}",
                  f"{c['measured_live_bytes']:,}", "✓" if c["bytes_match"] else f"≠ {c['formula_bytes']:,}",
                  f"{c['compression']:.2f}")
    console.print(t)
    console.print(f"model's own forward perplexity on the same windows: {full['model_forward_ppl']:.4f} "
                  f"(full-cache decode: {full['ppl']:.4f}); bytes: the first batch's cache ({fc['batch_size']} × "
                  f"{fc['seq_len']} tokens, {fc['dtype']}) measured from its tensors after decoding; formula "
                  f"Σ_layers Σ_heads (R_k + R_v)·T·B·bytes (full: 2·L·H_kv·d·T·B·bytes)", soft_wrap=True)
    if not per_layer:
        return
    for r in (x for x in results if "layers" in x):  # fd-online rows have no Gram-based errors (issue 6)
        lt = Table(title=f"{r['label']}: per-layer errors on the held-out text (relative; Lesens at each head's "
                         f"key rank, oracle fits on this text)")
        for col in ("layer", "score err", "score err (Σq)", "key err", "value err (W_O)", "attn-out err",
                    "K-only opt", "attn-aware opt", "Lesens ε/‖KQᵀ‖²"):
            lt.add_column(col, justify="right")
        for l, row in enumerate(r["layers"]):
            lt.add_row(str(l), f"{row['scores']:.4f}", f"{row['scores_sum']:.4f}", f"{row['keys']:.4f}",
                       f"{row['values']:.4f}", f"{row['attn_out']:.4f}", f"{row['lesens']['konly_opt_err']:.4f}",
                       f"{row['lesens']['kq_opt_err']:.4f}", f"{row['lesens']['gap_rel']:.2e}")
        console.print(lt)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from kvsplice.fit_bases import write_json
    from kvsplice.io.loading import LoadError, first_line

    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.method == "static":
            if not args.bases:
                raise EvalError("--bases FILE is required (saved bases from python -m kvsplice.fit_bases)")
            for b in args.bases:  # fail fast, before loading the model
                if not Path(b).is_file():
                    raise FileNotFoundError(f"bases file not found: {b}")
        ctx = make_context(args)
        results = EVALUATORS[args.method](ctx, args)
        print_results(ctx, results)
        print_diagnostics(results)  # fd-online + §3.5 diagnostics (issue 6)
        if args.json:
            report = {"model": ctx.loaded.describe(), "model_fingerprint": ctx.fingerprint,
                      "data": ctx.data_info, "chunk_size": ctx.chunk_size, "batch_size": ctx.batch_size,
                      "full": ctx.full(), "results": results}
            write_json(report, args.json)
            print(f"wrote {args.json}")
    except (EvalError, LoadError, BasesMismatchError, FileNotFoundError) as e:
        print(f"eval_bases: error: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        print(f"eval_bases: error: {first_line(e)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

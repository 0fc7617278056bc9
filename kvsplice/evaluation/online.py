"""``kvsplice eval-bases --method fd-online``: online frequent-directions bases per chunk
(:class:`~kvsplice.online.method.OnlineDecoder` over a :class:`~kvsplice.online.chunked.ChunkedCache`; no calibration,
no ``--bases``), with per-layer error diagnostics vs their bounds on the first ``--err-windows`` windows,
teacher-forced (:func:`~kvsplice.online.diagnostics.online_qkv_diagnostics`), printed by :func:`print_diagnostics`.
With ``--max-chunks`` (merges re-project old tokens) use ``--chunk-size 1`` for true online semantics; without
merges the result does not depend on the chunk size."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvsplice.evaluation.context import EvalContext, EvalError
from kvsplice.evaluation.options import EvalBasesOptions
from kvsplice.online.diagnostics import online_qkv_diagnostics
from kvsplice.online.method import OnlineDecoder, calibrate_thresholds

__all__ = ["eval_fd_online", "print_diagnostics"]


def _check_tau_options(opts: EvalBasesOptions) -> None:
    """``--tau-percentile`` with its ``--tau-calib`` text (never the ``--data`` text) or ``--tau-k`` / ``--tau-v``."""
    p, calib = opts.tau_percentile, opts.tau_calib
    if p is None:
        if calib is not None:
            raise EvalError("--tau-calib needs --tau-percentile P")
        return
    if calib is None:
        raise EvalError("--tau-percentile needs --tau-calib PATH (calibration text, not the --data text)")
    if not 0 <= p <= 100:
        raise EvalError(f"--tau-percentile must be in [0, 100], got {p}")
    if Path(calib).expanduser().resolve() == Path(opts.data).expanduser().resolve():
        raise EvalError("--tau-calib must not be the --data text (calibrate τ on other text)")
    if opts.tau_k is not None or opts.tau_v is not None:
        raise EvalError("give either --tau-percentile or --tau-k / --tau-v, not both")


def _calibrate_tau(ctx: EvalContext, opts: EvalBasesOptions, kw: dict[str, Any]) -> dict[str, Any]:
    """``--tau-percentile``: τ_k/τ_v from :func:`kvsplice.online.method.calibrate_thresholds` on ``--tau-calib`` windows."""
    from kvsplice.loading import iter_texts, token_stream

    seq_len = ctx.windows.shape[1]
    ids, _ = token_stream(iter_texts(opts.tau_calib, option="tau-calib", split="train"), ctx.loaded.tokenizer,
                          opts.eval_tokens, progress=ctx.progress, desc="tokenize tau-calib")
    n = ids.numel() // seq_len
    if n < 1:
        raise EvalError(f"--tau-calib {opts.tau_calib}: only {ids.numel()} tokens, fewer than --seq-len {seq_len}")
    windows = ids[: n * seq_len].view(n, seq_len)  # (N, T)
    cal = calibrate_thresholds(ctx.model, windows.split(ctx.batch_size), percentile=opts.tau_percentile, **kw)
    cal["source"] = str(opts.tau_calib)
    tv = "—" if cal["tau_v"] is None else f"{cal['tau_v']:.6g}"
    print(f"fd-online: τ from the {cal['percentile']:g}th percentile of {cal['n_residuals']:,} per-token "
          f"{'relative ' if kw['relative'] else ''}residuals ({cal['n_tokens']:,} tokens of {opts.tau_calib}, "
          f"thresholds off): τ_k = {cal['tau_k']:.6g}, τ_v = {tv}")
    return cal


def eval_fd_online(ctx: EvalContext, opts: EvalBasesOptions) -> list[dict[str, Any]]:
    """``--method fd-online``: perplexity through a :class:`ChunkedCache`, its bytes (coefficients + bases +
    sketches, split per sequence), chunk counts J and the diagnostics. With ``--tau-percentile`` τ_k/τ_v are first
    calibrated on ``--tau-calib`` (:func:`_calibrate_tau`)."""
    info = ctx.info
    _check_tau_options(opts)
    kw = opts.online_kw()
    if max(kw["rank_k"], kw["rank_v"]) > info.head_dim:
        raise EvalError(f"--rank / --rank-v must be <= the model's head_dim {info.head_dim}")
    tau_cal = None
    if opts.tau_percentile is not None:
        tau_cal = _calibrate_tau(ctx, opts, kw)
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
    diag = online_qkv_diagnostics(ctx.model, ctx.windows[: ctx.err_windows], **kw) \
        if opts.diagnostics else None
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
        t = Table(title=f"{r['label']}: observed attention errors vs their bounds per layer (teacher-forced, "
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

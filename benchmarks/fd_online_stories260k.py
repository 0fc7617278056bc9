"""Online frequent-directions bases vs global post-RoPE bases at matched cache bytes, on stories260K + TinyStories.

    python -m benchmarks.fd_online_stories260k     # → results/fd_online_stories260k.json + .md (≈ 5–8 min, 1 CPU)

* Model: ``../shared/data/stories260K`` (llama2.c; 5 layers, 8 query / 4 KV heads, head_dim 8, RoPE), converted to
  a temporary HF Llama directory and loaded with :func:`kvsplice.loading.load_model`.
* Eval text: the TinyStories **validation** sample (``yuninxia_moe-routing-bench__tinystories_val.txt``), story by
  story with BOS, first ``--windows`` × 512 tokens (the model's context) — the same windows as
  ``benchmarks/stories260k_bases.py`` uses (its first ones).
* Global bases: calibrated (post-RoPE Grams) on the TinyStories **train** sample
  (``gusjengis_toy-RNN__tinystories_sample.txt``, first ``--calib-tokens``), fitted with :func:`kvsplice.lowrank.fits
  .fit_bases` for ``kq`` and ``gqa-sum`` (the attention-aware methods) at rank R = 2/4/6 (value rank = key rank);
  ``ksvd`` post and ``kq`` pre-RoPE at the same ranks for reference. Decoded with
  ``Decoder(model, LowRank(bases))`` (exact for any call size).
* fd-online: :class:`kvsplice.online.method.OnlineDecoder` (no calibration), a handful of configurations per budget, all
  listed. Bytes per sequence = coefficients + every basis the cache holds (warm-up tokens at full dimension)
  measured from the cache's tensors after decoding a whole window (:meth:`ChunkedCache.nbytes_breakdown`); the FD
  sketches (fixed ``2·2ℓ·(d + d_v)`` floats per layer and KV head) are reported separately. A configuration is
  *matched* when its bytes (without sketches) are ≤ the global method's ``(R_k + R_v)·T·L·H_kv·4`` at T = 512.
  Configurations without merges are decoded in one prefill call per window — identical to token-by-token decoding
  (the online rule does not depend on call sizes; ``tests/kvsplice/online/test_online.py``); a configuration with ``max_chunks``
  (J_max merges re-project old tokens) is decoded token by token, as an online decoder would.
* Attention error (teacher-forced, no propagation: the exact model's q/k/v of the first window on every layer, for
  every method alike): ``rel_out`` = ``(Σ‖o − ô‖²/Σ‖o‖²)^½`` of the head outputs, mean over layers; the largest
  logit error ``ε``; whether every attention-error bound held on every layer, and the slack (bound / observed, the largest
  bound over the largest observation, worst layer) — :mod:`kvsplice.online.diagnostics`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch


from benchmarks.harness.header import command as command_line, machine, revision
from benchmarks.harness.options import add_json, add_threads, command, parser
from benchmarks.harness.paths import CALIB, EVAL, RESULTS, STORIES

from kvsplice.decode import Decoder, DenseKV, perplexity
from kvsplice.lowrank.method import LowRank
from kvsplice.lowrank.calibrate import calibrate, calibration_batches
from kvsplice.convert.llama2c import convert_llama2c
from kvsplice.lowrank.fits import fit_bases
from kvsplice.loading import iter_texts, load_model, token_stream
from kvsplice.lowrank.diagnostics import bases_diagnostics
from kvsplice.core.diagnostics import format_diagnostics
from kvsplice.online.diagnostics import online_qkv_diagnostics
from kvsplice.online.method import OnlineDecoder


RANKS = (2, 4, 6)

# fd-online candidates per global rank R (budget 2R numbers per token and KV head); each has its bytes measured.
FD_CONFIGS: dict[int, list[dict]] = {
    2: [dict(rank_k=1, rank_v=1, max_chunk_len=16, fd_decay=0.95),
        dict(rank_k=2, rank_v=1, max_chunk_len=64, fd_decay=0.95),
        dict(rank_k=2, rank_v=1, max_chunk_len=64)],
    4: [dict(rank_k=3, rank_v=3, max_chunk_len=32),
        dict(rank_k=3, rank_v=3, max_chunk_len=32, fd_decay=0.9),
        dict(rank_k=3, rank_v=2, max_chunk_len=16, fd_decay=0.95),
        dict(rank_k=4, rank_v=3, max_chunk_len=128, fd_decay=0.95),
        dict(rank_k=3, rank_v=3, tau_k=0.3, relative=True, min_chunk_len=16, max_chunk_len=128, max_chunks=16,
             fd_decay=0.95)],
    6: [dict(rank_k=5, rank_v=5, max_chunk_len=64, fd_decay=0.95),
        dict(rank_k=5, rank_v=4, max_chunk_len=32, fd_decay=0.95),
        dict(rank_k=6, rank_v=4, max_chunk_len=64, fd_decay=0.95),
        dict(rank_k=6, rank_v=5, max_chunk_len=128, fd_decay=0.95)],
}


def _label(kw: dict) -> str:
    parts = [f"r={kw['rank_k']}/{kw['rank_v']}", f"L={kw['max_chunk_len']}"]
    if kw.get("tau_k") is not None:
        parts.append(f"τ_k={kw['tau_k']}{' rel' if kw.get('relative') else ''}")
    if kw.get("min_chunk_len", 1) > 1:
        parts.append(f"m={kw['min_chunk_len']}")
    if kw.get("max_chunks"):
        parts.append(f"J_max={kw['max_chunks']}")
    if kw.get("fd_decay", 1.0) != 1.0:
        parts.append(f"γ={kw['fd_decay']}")
    return ", ".join(parts)


def _summary(diag: list[dict]) -> dict:
    """Across layers: mean relative head-output error, the largest logit error, bounds held, worst slack."""
    return {
        "rel_out_mean": sum(d["rel_output_err"] for d in diag) / len(diag),
        "logit_err_max": max(d["logit_err"] for d in diag),
        "softmax_l1_max": max(d["softmax_l1"] for d in diag),
        "bounds_hold": all(d["holds"] and d.get("holds_recorded", True) for d in diag),
        "slack_logit": min(d["logit_slack"] for d in diag),
        "slack_softmax_tanh": min(d["softmax_slack"] for d in diag),
        "slack_softmax_sinh": min(d["softmax_sinh_slack"] for d in diag),
        "slack_output": min(d["output_slack"] for d in diag),
        "tightest_logit": min(d["logit_tightest"] for d in diag),
        "tightest_output": min(d["output_tightest"] for d in diag),
        **({"chunks_max": max(d["chunks_max"] for d in diag),
            "chunks_mean": sum(d["chunks_mean"] for d in diag) / len(diag)} if "chunks_max" in diag[0] else {}),
    }


def load(a: argparse.Namespace, tmp: Path):
    out = convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp / "stories260K")
    loaded = load_model(out)
    ev, _ = token_stream(iter_texts(str(EVAL), split="validation"), loaded.tokenizer, a.windows * 512)
    cal, _ = token_stream(iter_texts(str(CALIB)), loaded.tokenizer, a.calib_tokens)
    return loaded.model, ev.view(a.windows, 512), cal


@command
def main(argv=None) -> int:
    p = parser(__file__, __doc__)
    p.add_argument("--windows", type=int, default=4, help="eval windows of 512 tokens (default 4)")
    p.add_argument("--calib-tokens", type=int, default=65536)
    add_json(p, RESULTS / "fd_online_stories260k.json")
    p.add_argument("--md", default=str(RESULTS / "fd_online_stories260k.md"))
    add_threads(p)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model, windows, cal = load(a, Path(tmp))
    n_win, t = windows.shape
    cfg = model.config
    L, hkv, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    diag_ids = windows[:1]
    print(f"stories260K: {L} layers, {cfg.num_attention_heads}/{hkv} heads, d={d}; eval {n_win}×{t} tokens, "
          f"calibration {cal.numel()} tokens", flush=True)

    full_ppl = perplexity(Decoder(model, DenseKV()), windows)
    rows: list[dict] = []

    # ---- global bases
    stats = {rope: calibrate(model, calibration_batches(cal, 512, 8), rope=rope, progress=False)
             for rope in ("post", "pre")}
    for r in RANKS:
        for method, rope in (("kq", "post"), ("gqa-sum", "post"), ("ksvd", "post"), ("kq", "pre")):
            bases = fit_bases(stats[rope], method, rank=r)
            t0 = time.perf_counter()
            ppl = perplexity(Decoder(model, LowRank(bases)), windows)
            diag = bases_diagnostics(model, bases, diag_ids)
            row = {"budget_rank": r, "kind": "global", "method": f"{method} ({rope}-RoPE)", "rope": rope,
                   "config": {"method": method, "rank": r}, "ppl": ppl,
                   "bytes": bases.elements_per_token() * t * 4, "sketch_bytes": 0,
                   "reference_only": (method, rope) not in (("kq", "post"), ("gqa-sum", "post")),
                   "seconds": time.perf_counter() - t0, **_summary(diag), "layers": diag}
            rows.append(row)
            print(f"R={r} {row['method']:<18} ppl {ppl:8.3f}  rel_out {row['rel_out_mean']:.3f}", flush=True)

    # ---- fd-online
    for r in RANKS:
        budget = 2 * r * L * hkv * t * 4
        for kw in FD_CONFIGS[r]:
            t0 = time.perf_counter()
            dec = OnlineDecoder(model, **kw)
            chunk = 1 if kw.get("max_chunks") else None
            ppl = dec.perplexity(windows, chunk_size=chunk)
            cache = dec.new_cache(1)
            dec(windows[:1], cache)
            br = cache.nbytes_breakdown()
            nbytes = sum(br.values()) - br["sketch"]
            diag = online_qkv_diagnostics(model, diag_ids, **kw)
            row = {"budget_rank": r, "kind": "fd-online", "method": "fd-online", "rope": "post", "config": kw,
                   "label": _label(kw), "ppl": ppl, "bytes": nbytes, "sketch_bytes": br["sketch"],
                   "bytes_breakdown": br, "budget_bytes": budget, "matched": nbytes <= budget,
                   "decode": "token by token" if chunk == 1 else "prefill (= token by token)",
                   "seconds": time.perf_counter() - t0, **_summary(diag), "layers": diag}
            rows.append(row)
            print(f"R={r} fd-online {_label(kw):<55} ppl {ppl:8.3f}  bytes {nbytes / budget:.3f}×  "
                  f"J {row['chunks_max']}  rel_out {row['rel_out_mean']:.3f}  {row['seconds']:.0f}s", flush=True)

    report = {
        "command": command_line(__file__, argv), "revision": revision(),
        "environment": machine(a.threads),
        "model": {"source": str(STORIES / "stories260K.bin"), "n_layer": L, "n_head": cfg.num_attention_heads,
                  "n_kv_head": hkv, "head_dim": d},
        "eval": {"source": str(EVAL), "windows": n_win, "seq_len": t, "tokens": n_win * t,
                 "diagnostics_windows": 1},
        "calibration": {"source": str(CALIB), "tokens": int(cal.numel())},
        "full_ppl": full_ppl, "rows": rows, "seconds": time.perf_counter() - t_start,
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(report, indent=1, default=float))
    Path(a.md).write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {a.json}, {a.md} ({report['seconds']:.0f} s)")
    return 0


def markdown(rep: dict) -> str:
    L = rep["model"]
    per_tok = 2 * L["n_layer"] * L["n_kv_head"] * L["head_dim"]
    lines = [f"<!-- made by: {rep['command']} -->",
             f"stories260K ({L['n_layer']} layers, {L['n_head']}/{L['n_kv_head']} heads, head_dim {L['head_dim']}) on "
             f"{rep['eval']['tokens']:,} TinyStories validation tokens ({rep['eval']['windows']} windows × "
             f"{rep['eval']['seq_len']}); global bases calibrated on {rep['calibration']['tokens']:,} train-sample "
             f"tokens. Full K/V cache: ppl **{rep['full_ppl']:.3f}** ({per_tok} numbers/token). Bytes are per "
             f"512-token sequence, fp32, coefficients + bases (fd-online: FD sketches listed separately); "
             f"'×budget' = bytes / the global rank-R cache's bytes. rel_out: teacher-forced head-output error "
             f"(Σ‖o−ô‖²/Σ‖o‖²)^½, mean over layers; ε: max logit error; J: chunks per stream at T = 512 (max / mean "
             f"over layers and KV heads).", ""]
    lines += ["| R (budget) | method | config | ppl | bytes | ×budget | sketch bytes | J max / mean | rel_out | ε max "
              "| bounds hold |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in RANKS:
        rs = [x for x in rep["rows"] if x["budget_rank"] == r]
        budget = next(x["bytes"] for x in rs if x["kind"] == "global")
        glob = [x for x in rs if x["kind"] == "global"]
        fd = sorted((x for x in rs if x["kind"] == "fd-online"), key=lambda x: x["ppl"])
        best_g = min((x for x in glob if not x["reference_only"]), key=lambda x: x["ppl"])
        best_fd = min((x for x in fd if x["matched"]), key=lambda x: x["ppl"], default=None)
        for x in glob + fd:
            name = x["method"] + (" (reference)" if x.get("reference_only") else "")
            cfg = x.get("label", f"R={r}")
            if x is best_g or x is best_fd:
                name = f"**{name}**"
            j = f"{x['chunks_max']} / {x['chunks_mean']:.1f}" if "chunks_max" in x else "—"
            sk = f"{x['sketch_bytes']:,}" if x["kind"] == "fd-online" else "—"
            match = "" if x["kind"] == "global" or x["matched"] else " (over)"
            lines.append(f"| {r} ({2 * r}/token) | {name} | {cfg} | {x['ppl']:.3f} | {x['bytes']:,} | "
                         f"{x['bytes'] / budget:.3f}{match} | {sk} | {j} | {x['rel_out_mean']:.3f} | "
                         f"{x['logit_err_max']:.1f} | {'yes' if x['bounds_hold'] else 'NO'} |")
    lines += ["", "Best matched fd-online vs best global attention-aware post-RoPE method (ppl):", ""]
    for r in RANKS:
        rs = [x for x in rep["rows"] if x["budget_rank"] == r]
        g = min((x for x in rs if x["kind"] == "global" and not x["reference_only"]), key=lambda x: x["ppl"])
        f = min((x for x in rs if x["kind"] == "fd-online" and x["matched"]), key=lambda x: x["ppl"], default=None)
        k = next(x for x in rs if x["method"].startswith("ksvd"))
        if f is not None:
            lines.append(f"* R={r}: fd-online {f['ppl']:.2f} ({f['label']}, {f['bytes'] / g['bytes']:.3f}× bytes, "
                         f"J={f['chunks_max']}) vs {g['method']} {g['ppl']:.2f}; K-only global (ksvd post) "
                         f"{k['ppl']:.2f}.")
    lines += ["", "Bound slack on every row (bound / observed, ratio of the maxima over queries and heads, worst "
              "layer): logit ‖q‖·max ρ_k · s, softmax 2 tanh(δ̄/4) and 2 sinh(δ̄/2) (δ̄ = 2 × logit bound), output "
              "‖Δα‖₁ max‖v‖ + max‖Δv‖:", "",
              "| R | method | config | logit | softmax tanh | softmax sinh | output |", "|---|---|---|---|---|---|---|"]
    for x in rep["rows"]:
        lines.append(f"| {x['budget_rank']} | {x['method']} | {x.get('label', '')} | {x['slack_logit']:.2f} | "
                     f"{x['slack_softmax_tanh']:.2f} | {x['slack_softmax_sinh']:.3g} | {x['slack_output']:.2f} |")
    r4 = [x for x in rep["rows"] if x["budget_rank"] == 4]
    best_fd = min((x for x in r4 if x["kind"] == "fd-online" and x["matched"]), key=lambda x: x["ppl"])
    best_g = min((x for x in r4 if x["kind"] == "global" and not x["reference_only"]), key=lambda x: x["ppl"])
    lines += ["", "Per-layer diagnostics at R = 4 (first window, teacher-forced; max over queries and heads; "
              "slack = the tightest per-query bound/observed):", "",
              format_diagnostics(best_fd["layers"], f"fd-online {best_fd['label']}"), "",
              format_diagnostics(best_g["layers"], best_g["method"]), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

"""The stack on a real pretrained model: token subset → low-rank coefficients → int8, on stories260K, in both doors.

    python -m benchmarks.stack_stories260k      # → results/stack_stories260k.json + .md (a few minutes, 1 CPU thread)

1. Convert ``../shared/data/stories260K`` (llama2.c) into a temporary HF Llama directory and load it
   (:func:`kvsplice.loading.load_model`); calibrate post-RoPE Grams on the TinyStories **train** sample
   (``--calib-tokens``, windows of 512) and fit ``gqa-concat`` bases at every ``--ranks`` (value rank = key rank).
2. Evaluate on the TinyStories **validation** sample: ``--windows`` windows of ``--prompt + --cont`` tokens. Each
   window's prompt is prefilled into a fresh cache, the continuation is fed teacher-forced in one call and its
   ``--cont`` tokens are scored (the first by the prefill's last position) — the protocol of token selection,
   applied to every method alike (:func:`kvsplice.decode.score_continuation`).
3. Methods: the full cache (fp32) and full int8; low rank alone (fp32, int8); token selection alone (BalanceKV,
   full keys/values) at every ``--budgets``; and the stack ``TokenSelection(balancekv, budget,
   store=LowRank(bases, cache_quant="int8"))`` at every budget × rank. Each through the package's ``Decoder`` and
   through transformers' forward with ``KVSpliceHFCache`` (the HF door): both perplexities are reported and must
   agree (they run the same ``attend``).
4. Bytes: the cache of the last window, measured from its tensors (:func:`kvsplice.report.memory.measure_cache`),
   == the method's formula, in both doors; per token seen (``prompt + cont - 1``) and as a ratio to the full fp16
   K/V cache of the same tokens (fp32 caches count 4 bytes per number; int8 rows 1 byte + a 2-byte scale per row;
   a kept token's log-weight is fp32).
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


from benchmarks.harness.header import command as command_line, machine, revision
from benchmarks.harness.options import add_json, add_windows, command, parser
from benchmarks.harness.paths import CALIB, EVAL, RESULTS, STORIES
from kvsplice import build_method
from kvsplice.decode import Decoder, score_continuation
from kvsplice.hf import KVSpliceHFCache
from kvsplice.hf.measure import continuation_logits
from kvsplice.io.outputs import write_json
from kvsplice.lowrank import calibrate, calibration_batches, fit_bases
from kvsplice.report.memory import measure_cache
from kvsplice.select import TokenSelection



def methods(bases: dict[int, object], budgets: list[int], selector: str) -> dict[str, tuple[dict, object]]:
    """name → (description, method) for every configuration of the study, each built from its spec
    (:func:`kvsplice.build_method`; a fresh selector per method: its own random stream)."""
    lowrank = lambda b, quant=None: {"name": "lowrank", "bases": b, "cache_quant": quant}  # noqa: E731
    select = lambda n, store: {"name": "token_selection", "selector": {"name": selector}, "budget": n,  # noqa: E731
                               "store": store}
    specs = {"full": ({"kind": "full", "quant": None}, "dense"),
             "full-int8": ({"kind": "full", "quant": "int8"}, "int8")}
    for r, b in bases.items():
        specs[f"lowrank-r{r}"] = ({"kind": "lowrank", "rank": r, "quant": None}, lowrank(b))
        specs[f"lowrank-r{r}-int8"] = ({"kind": "lowrank", "rank": r, "quant": "int8"}, lowrank(b, "int8"))
    for n in budgets:
        specs[f"select-b{n}"] = ({"kind": "select", "budget": n, "quant": None}, select(n, "dense"))
        for r, b in bases.items():
            specs[f"stack-b{n}-r{r}-int8"] = ({"kind": "stack", "budget": n, "rank": r, "quant": "int8"},
                                              select(n, lowrank(b, "int8")))
    return {name: (desc, build_method(spec)) for name, (desc, spec) in specs.items()}


@torch.no_grad()
def hf_continuation(model, method, ids: torch.Tensor, p: int) -> tuple[float, torch.Tensor, KVSpliceHFCache]:
    """:func:`score_continuation` through transformers' forward with the HF door."""
    cache = KVSpliceHFCache(model, method, capacity=method.capacity(p, ids.shape[1] - p))
    logits = continuation_logits(model, cache, ids, p)  # (B, T - p, V)
    nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, p:].reshape(-1)).item()
    return nll, logits, cache


def evaluate(model, windows: torch.Tensor, p: int, name: str, method) -> dict:
    nll = {"decoder": 0.0, "hf": 0.0}
    for w in windows:
        ids = w[None]
        if isinstance(method, TokenSelection):
            method.selector.reseed()
        n_dec, _, c_dec = score_continuation(Decoder(model, method), ids, p)
        if isinstance(method, TokenSelection):
            method.selector.reseed()
        n_hf, _, c_hf = hf_continuation(model, method, ids, p)
        nll["decoder"] += n_dec / len(windows)
        nll["hf"] += n_hf / len(windows)
    bound = Decoder(model, method).method
    t_seen = windows.shape[1] - 1
    held = c_dec.seq_len
    measured = {"decoder": measure_cache(c_dec).live_bytes, "hf": measure_cache(c_hf).live_bytes}
    formula = bound.bytes_formula(1, held, c_dec.dtype)
    a = bound.adapter
    full_fp16 = 2 * a.n_layer * a.n_kv_head * a.head_dim * t_seen * 2
    return {"name": name, "ppl": math.exp(nll["decoder"]), "ppl_hf": math.exp(nll["hf"]),
            "tokens_seen": t_seen, "tokens_held": held, "bytes": measured["decoder"], "bytes_hf": measured["hf"],
            "bytes_formula": formula, "bytes_per_token": measured["decoder"] / t_seen,
            "ratio_vs_fp16_full": full_fp16 / measured["decoder"],
            "bytes_match": measured["decoder"] == measured["hf"] == formula == c_dec.nbytes()}


def fmt_md(rep: dict) -> str:
    res = {r["name"]: r for r in rep["results"]}
    full = res["full"]["ppl"]
    c = rep["config"]
    lines = [f"<!-- made by: {rep['command']} -->",
             f"stories260K (5 layers, 8 query / 4 KV heads, head_dim 8), {c['windows']} TinyStories validation "
             f"windows: prompt {c['prompt']} tokens prefilled, the next {c['cont']} scored (teacher-forced, one "
             f"call). Bases: gqa-concat post-RoPE, calibrated on {rep['calibration']['tokens']:,} train-sample "
             f"tokens. Stack = `TokenSelection({c['selector']}, budget, store=LowRank(bases, cache_quant=\"int8\"))`. "
             f"Bytes: the cache after the last window ({rep['results'][0]['tokens_seen']} tokens seen), measured == "
             f"formula in both doors: **{rep['checks']['bytes_match_all']}**; ppl through the Decoder vs through "
             f"transformers' forward (HF door), max relative difference {rep['checks']['ppl_door_max_rel']:.1e}.",
             "", f"Command: `{rep['command']}`", "",
             "| method | budget | rank | ppl (Decoder) | ppl (HF door) | Δ vs full | bytes / token seen | "
             "× smaller than full fp32 | × smaller than full fp16 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rep["results"]:
        d = r["config"]
        lines.append(f"| {r['name']} | {d.get('budget', '—')} | {d.get('rank', '—')} | {r['ppl']:.4f} | "
                     f"{r['ppl_hf']:.4f} | {100 * (r['ppl'] / full - 1):+.2f} % | {r['bytes_per_token']:.1f} | "
                     f"{res['full']['bytes'] / r['bytes']:.2f} | {r['ratio_vs_fp16_full']:.2f} |")
    return "\n".join(lines) + "\n"


@command
def main(argv=None) -> int:
    ap = parser(__file__, __doc__)
    ap.add_argument("--calib-tokens", type=int, default=32768)
    add_windows(ap, 16, data=False)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 6, 8])
    ap.add_argument("--budgets", type=int, nargs="+", default=[192, 96, 48])
    ap.add_argument("--selector", default="balancekv")
    add_json(ap, RESULTS / "stack_stories260k.json")
    ap.add_argument("--md", default=str(RESULTS / "stack_stories260k.md"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    for f in (STORIES / "stories260K.bin", STORIES / "tok512.bin", CALIB, EVAL):
        if not f.is_file():
            print(f"missing reference data: {f}", file=sys.stderr)
            return 1
    from kvsplice.convert.llama2c import convert_llama2c
    from kvsplice.loading import iter_texts, load_model, token_stream

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", Path(tmp) / "m"))
    model, tok = loaded.model, loaded.tokenizer
    calib_ids, _ = token_stream(iter_texts(str(CALIB), split="train"), tok, a.calib_tokens)
    stats = calibrate(model, calibration_batches(calib_ids, 512, 8), rope="post", progress=False)
    bases = {r: fit_bases(stats, "gqa-concat", rank=r) for r in a.ranks}
    t = a.prompt + a.cont
    eval_ids, _ = token_stream(iter_texts(str(EVAL), split="validation"), tok, a.windows * t)
    windows = eval_ids[: a.windows * t].view(a.windows, t)  # (N, prompt + cont)
    results = []
    for name, (desc, method) in methods(bases, a.budgets, a.selector).items():
        row = evaluate(model, windows, a.prompt, name, method)
        row["config"] = desc
        results.append(row)
        print(f"{name:24s} ppl {row['ppl']:.4f} (hf {row['ppl_hf']:.4f})  {row['bytes_per_token']:7.1f} B/token "
              f"({row['ratio_vs_fp16_full']:.2f}x vs fp16)  bytes==formula {row['bytes_match']}", flush=True)
    rep = {"command": command_line(__file__, argv), "revision": revision(),
           "config": {"windows": a.windows, "prompt": a.prompt, "cont": a.cont, "ranks": a.ranks,
                      "budgets": a.budgets, "selector": a.selector, "bases": "gqa-concat post-RoPE"},
           "calibration": {"source": CALIB.name, "tokens": stats.n_tokens},
           "eval": {"source": EVAL.name, "tokens": int(windows.numel())},
           "checks": {"bytes_match_all": all(r["bytes_match"] for r in results),
                      "ppl_door_max_rel": max(abs(r["ppl_hf"] / r["ppl"] - 1) for r in results)},
           "machine": machine(1),
           "seconds": round(time.perf_counter() - t0, 1), "results": results}
    write_json(rep, a.json)
    Path(a.md).write_text(fmt_md(rep))
    print(f"wrote {a.json} and {a.md}")
    return 0 if rep["checks"]["bytes_match_all"] and rep["checks"]["ppl_door_max_rel"] < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())

"""SmolLM2-135M-Instruct: perplexity vs cache bytes per token for every method family and their stacks, on the same
evaluation windows; the Pareto front; the budget planner's stacks at 4x / 8x / 16x; the paper's claims.

    python -m benchmarks.smollm2_frontier                 # every row; --resume keeps the finished ones
    python -m benchmarks.smollm2_frontier --resume --force --only kivi4  # rows whose id contains kivi4; --list
    python -m benchmarks.smollm2_frontier --resume --force --only        # no row run: the report from the JSON

Protocols (kvsplice.evaluation.protocol; text: ``benchmarks/lib/smollm2_windows.py``): ``P`` (the frontier), 4
validation windows of 1,024 tokens, the first 768 the prompt (compressed at prefill, or stored compressed), the last
256 decoded teacher-forced and scored; bytes per token: the closed form at fp16 for the tokens held after the
prefill, per prompt token (measured == formula in every batch), vs the fp16 full cache's 23,040 B. ``W`` (low
rank): every token of the 4 windows over the compressed cache (chunks of 64). ``S`` (kvpress's): 5 windows of 832,
768 compressed, 64 scored, beside kvpress 0.5.5's published numbers (quoted). Calibration: 32,768 train-sample
tokens, one pass (both RoPE modes); every choice is made on calibration text or the tuning slice.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.harness.report import figure, markdown
from benchmarks.harness.runner import Study
from benchmarks.harness.studies import load as load_study
from benchmarks.lib.smollm2_windows import WORK
from kvsplice.lowrank.calibrate import load_stats
from kvsplice.lowrank.fits import ksvd_basis

SETTINGS = load_study("smollm2_frontier")
KVPRESS = {(n, x): v for n, x, v in SETTINGS["kvpress"]}  # (press, ratio) → ppl increase %, quoted
ISSUE = SETTINGS["issue"]
ROWS: list[tuple[str, str, dict]] = SETTINGS["rows"]  # (id, protocol, spec) in the order they run


class _List(argparse.Action):  # --list: the rows' ids and protocols, then exit
    def __call__(self, parser, namespace, values, option_string=None):
        print("\n".join(f"{r[0]} ({r[1]})" for r in ROWS))
        parser.exit(0)


def options(p) -> None:
    p.add_argument("--only", nargs="*", help="run only rows whose id contains one of these (none given: run no row)")
    p.add_argument("--list", nargs=0, action=_List, help="list the rows' ids and exit")


def rows(run):
    """Each row of :data:`ROWS`: the resumed one, or measured."""
    from benchmarks.lib.smollm2_frontier_runs import Bench

    only, bench = run.args.only, None
    for rid, proto, spec in ROWS:
        row = run.previous(id=rid)
        if row is None and (only is None or any(o in rid for o in only)):
            bench = bench or Bench(run.args.threads)
            t0 = time.perf_counter()
            try:
                row = {k: v for k, v in bench.run(rid, proto, spec).items() if k != "measured"}
            except ImportError as e:  # transformers' QuantizedCache without its backend (optimum-quanto)
                run.say(f"{rid:<36} skipped: {str(e).splitlines()[0]}")
                continue
            run.say(f"{rid:<36} {row['label']:<44} ppl {row['ppl']:.4f}  {row['bytes_per_token']:.0f} B/tok  "
                    f"{row['ratio_vs_fp16_full']:.2f}x  ({time.perf_counter() - t0:.0f} s)")
        if row is not None:
            yield row


def family(row: dict) -> str:
    """The method family of a frontier row, by its id and label."""
    rid, label = row["id"], row["label"]
    if rid == "full" or rid.startswith("plan_"):
        return "full" if rid == "full" else "planner"
    if rid.startswith(("lr_", "joint_")):
        return "low rank (bases)"
    if "×" in label:
        return "token selection + quantisation" if "+ int8" in label or "+ kivi" in label else "token selection alone"
    return "quantisation"


def energy_claims(stats_path: Path) -> dict:
    """90 %-energy ranks (K-only / V-only spectra) of pre- and post-RoPE keys and of values, from the calibration
    stats: mean over layers and KV heads, and the share of heads at or below d/4."""
    if not stats_path.is_file():
        return {}
    sets, out = load_stats(stats_path), {}
    for name, s, gram in (("keys_pre", sets["pre"], "kk"), ("keys_post", sets["post"], "kk"),
                          ("values", sets["pre"], "vv")):
        ranks = [ksvd_basis(getattr(s, gram)[l, j], energy=0.9).rank for l in range(s.n_layer)
                 for j in range(s.n_kv_head)]
        out[name] = {"mean_rank_90": sum(ranks) / len(ranks), "share_le_d4": sum(r <= s.head_dim // 4 for r in ranks)
                     / len(ranks), "head_dim": s.head_dim}
    return out


def report_rows(rows: list[dict], kvpress: dict, claims: dict) -> list[dict]:
    """The YAML ``report:``'s rows, largest caches first: each with its ``part`` (protocol), ``family``, Δ %, ★ (P's
    Pareto front), S's ratio and kvpress's quoted best press; the planner's rows again (part ``plan``); the energy
    ranks."""
    base = {r["protocol"]: r["ppl"] for r in rows if r["id"] in ("full", "S_full", "W_full")}
    p = [r for r in rows if r["protocol"] == "P"]  # ★: no other row of P both ≤ in bytes per token and < in ppl
    front = {r["id"] for r in p if not any(o["bytes_per_token"] <= r["bytes_per_token"] and o["ppl"] < r["ppl"]
                                           for o in p)}
    kv_best = {x: f"{n} {v:+.1f} %" for (n, x), v in kvpress.items()}  # ratio → kvpress's best press
    out = []
    for r in sorted(rows, key=lambda r: (-r["bytes_per_token"], r["ppl"])):
        x = r["spec"].get("x") or 1
        row = {**r, "part": r["protocol"], "family": family(r), "star": "★" if r["id"] in front else "", "x": x,
               "kvpress": kv_best.get(x), "delta_pct": 100 * (r["ppl"] / base[r["protocol"]] - 1),
               "selector": r["spec"].get("selector", "full K/V")}
        out.append(row)
        if r["id"].startswith("plan_"):
            tuned = min(r["candidates"], key=lambda c: c["tuning_ppl"])
            out.append({**row, "part": "plan", "tuning_delta_pct": tuned["delta_pct"],
                        "n_candidates": len(r["candidates"])})
    return out + [{"part": "energy", "stream": k, **v, "share_le_d4_pct": 100 * v["share_le_d4"]}
                  for k, v in claims.items()]


def summary(run, rows) -> dict:
    run.notes["claims"] = energy_claims(WORK / "calib_stats.safetensors")  # (the report's last table)
    return {"claims": run.notes["claims"],
            "kvpress_quoted": {f"{n} {x}x": v for (n, x), v in KVPRESS.items()}, "issue": ISSUE}


STUDY = Study("smollm2_frontier", __doc__, rows, options=options, threads=2, summary=summary,
              markdown=lambda run, rows: markdown(STUDY.spec("report"), report_rows(
                  rows, KVPRESS, run.notes["claims"]), {"issue": ISSUE}),
              figure=lambda run, rows: figure(STUDY.spec("figure"), report_rows(rows, {}, {})))
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())

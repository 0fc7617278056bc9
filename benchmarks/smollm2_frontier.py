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

from benchmarks.harness.report import figure, markdown
from benchmarks.harness.runner import Study
from benchmarks.harness.studies import load as load_study
from benchmarks.lib import smollm2_report as report

SETTINGS = load_study("smollm2_frontier")
KVPRESS = {(n, x): v for n, x, v in SETTINGS["kvpress"]}  # (press, ratio) → ppl increase %, quoted
ISSUE = SETTINGS["issue"]


def stack_rows() -> list[tuple[str, str, dict]]:
    """``(id, protocol, spec)`` in the order they run (``benchmarks/studies/smollm2_frontier.yaml``)."""
    return [(rid, proto, dict(spec)) for rid, proto, spec in SETTINGS["rows"]]


class _List(argparse.Action):  # --list: the rows' ids and protocols, then exit
    def __call__(self, parser, namespace, values, option_string=None):
        print("\n".join(f"{r[0]} ({r[1]})" for r in stack_rows()))
        parser.exit(0)


def options(p) -> None:
    p.add_argument("--only", nargs="*", help="run only rows whose id contains one of these (none given: run no row)")
    p.add_argument("--list", nargs=0, action=_List, help="list the rows' ids and exit")


def rows(run):
    """Each row of :func:`stack_rows`: the resumed one, or measured."""
    from benchmarks.lib.smollm2_frontier_runs import Bench

    only, bench = run.args.only, None
    for rid, proto, spec in stack_rows():
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


def summary(run, rows) -> dict:
    from benchmarks.lib.smollm2_windows import WORK

    run.notes["claims"] = report.energy_claims(WORK / "calib_stats.safetensors")  # (the report's last table)
    return {"claims": run.notes["claims"],
            "kvpress_quoted": {f"{n} {x}x": v for (n, x), v in KVPRESS.items()}, "issue": ISSUE}


STUDY = Study("smollm2_frontier", __doc__, rows, options=options, threads=2, summary=summary,
              markdown=lambda run, rows: markdown(STUDY.spec("report"), report.report_rows(
                  rows, KVPRESS, run.notes["claims"]), {"issue": ISSUE}),
              figure=lambda run, rows: figure(STUDY.spec("figure"), report.report_rows(rows, {}, {})))
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())

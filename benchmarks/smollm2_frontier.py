"""SmolLM2-135M-Instruct: perplexity vs cache bytes per token for every method family and their stacks, on the same
evaluation windows; the Pareto front; the budget planner's stacks at 4x / 8x / 16x; the paper's claims.

    python -m benchmarks.smollm2_frontier                 # resumable: finished rows are kept in WORK/rows.json
    python -m benchmarks.smollm2_frontier --only kivi4    # rows whose id contains a string; --list to see them

Protocols (kvsplice.evaluation.protocol; ``benchmarks/lib/smollm2_windows.py`` for the text):

* ``P`` (the frontier): the 4 evaluation windows of 1,024 tokens; the first 768 of each are the prompt (a token
  selection compresses them at prefill; a storage method stores every token compressed), the last 256 are decoded
  teacher-forced over the cache and scored. Bytes per token: the method's closed form at fp16 storage for the
  tokens held after the prefill, per prompt token (measured == formula checked in every batch); the ratio is
  against the fp16 full K/V cache (2·30·3·64·2 = 23,040 B per token).
* ``W`` (the low-rank protocol): every token of the 4 windows attends over the compressed cache (chunks of
  64): full-cache ppl 8.2672.
* ``S`` (kvpress's protocol): 5 windows of 832 tokens of the validation text (768-token prompt
  compressed, 64 continuation tokens scored) — for comparing our selectors with kvpress 0.5.5's published numbers
  (quoted, not re-run: kvpress needs transformers <= 5.2).

Calibration: 32,768 train-sample tokens, one pass for every method (both RoPE modes, loss gradients), statistics
reused from WORK. Every choice (the planner's stacks, allocation) is made on calibration text or the tuning slice,
never on the evaluation windows. Writes results/smollm2_frontier.{json,md,png}.
"""

from __future__ import annotations

import json
import sys
import time

import benchmarks.lib.smollm2_windows as C
from benchmarks.harness.options import add_threads, command, parser
from benchmarks.harness.paths import RESULTS
from models.checkpoint import atomic_write

ROWS = C.WORK / "rows.json"
KVPRESS = {  # kvpress 0.5.5's numbers on protocol S (ppl increase vs the full cache, %): quoted
    ("KVzip", 2): 1.0, ("ObservedAttention", 4): 6.0, ("ObservedAttention", 8): 13.3}
ISSUE = {"full_W": 8.2672, "kq_pre_r32_W_pct": 35.5, "kq_pre_r16_W_pct": 214, "uniform_8x_S_pct": 36.9}


@command
def main(argv=None) -> int:
    ap = parser(__file__, __doc__)
    ap.add_argument("--only", nargs="*", help="run rows whose id contains one of these")
    ap.add_argument("--list", action="store_true")
    add_threads(ap, 2)
    ap.add_argument("--report-only", action="store_true", help="only write results/ from the finished rows")
    a = ap.parse_args(argv)
    from benchmarks.lib.smollm2_frontier_runs import Bench, stack_rows

    rows = stack_rows()
    if a.list:
        print("\n".join(f"{r[0]} ({r[1]})" for r in rows))
        return 0
    done = json.loads(ROWS.read_text()) if ROWS.is_file() else {}
    if not a.report_only:
        bench = Bench(a.threads)
        for rid, proto, spec in rows:
            if rid in done or (a.only and not any(o in rid for o in a.only)):
                continue
            t0 = time.perf_counter()
            try:
                res = bench.run(rid, proto, spec)
            except ImportError as e:  # transformers' QuantizedCache without its backend (optimum-quanto)
                print(f"{rid:<36} skipped: {str(e).splitlines()[0]}", flush=True)
                continue
            done[rid] = res
            # resumable: every finished row is on disk
            atomic_write(ROWS, lambda p: p.write_text(json.dumps(done, indent=1, default=str)))
            print(f"{rid:<36} {res['label']:<44} ppl {res['ppl']:.4f}  {res['bytes_per_token']:.0f} B/tok  "
                  f"{res['ratio_vs_fp16_full']:.2f}x  ({time.perf_counter() - t0:.0f} s)", flush=True)
    from benchmarks.lib.smollm2_report import energy_claims, write_report

    write_report(done, RESULTS, KVPRESS, ISSUE, energy_claims(C.WORK / "calib_stats.safetensors"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

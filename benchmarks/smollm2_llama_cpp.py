"""SmolLM2-135M-Instruct with llama.cpp's own KV cache quantisation (``-ctk`` / ``-ctv``: ``q8_0``, ``q4_0``,
``q4_1``, ``iq4_nl``, and ``f16`` as its baseline) as rows of our tables: protocol P's perplexity on the same windows,
the task suite's answers on the same instances, and the cache bytes per token llama.cpp reports — beside our stacks'
figures from ``results/`` (the same windows and seeds).

    python -m benchmarks.smollm2_llama_cpp                       # perplexity + the reduced task set, every type
    python -m benchmarks.smollm2_llama_cpp --types q8_0 q4_0     # some types (another process can run the others)
    python -m benchmarks.smollm2_llama_cpp --ours k8v4h int4h    # + our stacks on protocol P (loads the model)
    python -m benchmarks.smollm2_llama_cpp --types --tasks --exact-bytes --cross-check q8_0 f16
                      # bytes at 2^15 cells (exact in llama.cpp's log); llama-perplexity itself beside our API path
    python -m benchmarks.smollm2_llama_cpp --report-only         # write results/ from what is finished

Our extra task rows (``k8v4h``, ``int4`` at llama.cpp's bytes) come from ``OURS_TASKS_CMD`` (``eval_tasks``), read
when its output exists; our other rows from ``results/smollm2_frontier.json``, ``smollm2_tasks.json`` and
``smollm2_tasks_goals.json``.

llama.cpp runs through its C API (:mod:`kvsplice.convert.engines.llama_cpp`, ``$KVSPLICE_LLAMA_CPP``; docs/conversion.md
builds it) on the shared GGUF itself (its Q4_1 weights: what our loader dequantises to fp32), fed our tokenizer's ids.
K and V both in the type, flash attention on for every type (llama.cpp quantises V only with it). Protocol P
(:mod:`benchmarks.lib.llama_cpp_eval`): the 4 validation windows of 1,024 tokens of ``benchmarks.lib.smollm2_windows``,
768 prefilled, 256 decoded in chunks of 64 and scored. Tasks: ``make_instances`` with the suite's seeds 0..n-1 and the
validation stories, greedy, scored by the instance. Bytes per token: llama.cpp's log line at context creation
(``llama_kv_cache: size = ... K (q8_0): ... MiB, V (q8_0): ... MiB``) over its cells, beside ggml's closed form
(:mod:`kvsplice.convert.engines.kv_types`). Resumable: finished windows and instances are kept in
``checkpoints/smollm2_llama_cpp/<type>.json``; writes ``results/smollm2_llama_cpp.{json,md}``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

from benchmarks.harness.options import add_progress, add_threads, command, parser
from benchmarks.harness.paths import EVAL as STORIES, RESULTS, SMOLLM2 as MODEL
from benchmarks.lib.smollm2_llama_cpp_runs import TASKS, TYPES, _windows, cross_check, exact_bytes, run_ours, run_type


@command
def main(argv: Optional[list[str]] = None) -> int:
    ap = parser(__file__, __doc__, raw=True)
    ap.add_argument("--types", nargs="*", default=TYPES,
                    help="llama.cpp cache types, K and V both (default: %(default)s)")
    ap.add_argument("--no-perplexity", dest="perplexity", action="store_false", help="skip protocol P")
    ap.add_argument("--tasks", nargs="*", default=TASKS, help="suite tasks (none: no task rows)")
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024])
    ap.add_argument("--n", type=int, default=8, help="instances per task and length, seeds 0..n-1 (default 8)")
    ap.add_argument("--settings", nargs="+", default=["agnostic"], choices=("agnostic", "aware"))
    ap.add_argument("--ours", nargs="*", default=[], help="our method specs to run on protocol P too (loads the model)")
    ap.add_argument("--cross-check", nargs="*", default=[], metavar="TYPE",
                    help="run llama-perplexity itself with these types beside our API path (2 chunks of 1,024)")
    ap.add_argument("--exact-bytes", action="store_true",
                    help="read each type's cache per token at 2^15 cells (exact MiB in llama.cpp's log)")
    add_threads(ap)
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--report-only", action="store_true")
    add_progress(ap)
    a = ap.parse_args(argv)
    from kvsplice.convert.engines.kv_types import kv_type
    from kvsplice.convert.engines.llama_cpp import missing

    try:
        for t in a.types:
            kv_type(t)
    except ValueError as e:
        ap.error(str(e))
    if not a.report_only:
        why = missing(converter=False, bindings=True)
        if why and a.types:
            print(f"smollm2_llama_cpp: {why}", file=sys.stderr)
            return 2
        if not next(MODEL.glob("*.gguf"), None):
            print(f"smollm2_llama_cpp: no GGUF under {MODEL}", file=sys.stderr)
            return 2
        from kvsplice.loading import load_tokenizer
        from kvsplice.tasks.suite import make_instances

        t0 = time.perf_counter()
        tok = load_tokenizer(MODEL)
        windows = _windows(tok)
        insts = make_instances(a.tasks, tok, a.lengths, a.n, stories=str(STORIES)) if a.tasks else []
        print(f"windows {tuple(windows.shape)}, {len(insts)} instances ({time.perf_counter() - t0:.0f} s)", flush=True)
        for kv in a.types:
            run_type(kv, a, tok, windows, insts)
        if a.exact_bytes:
            exact_bytes(a.types)
        for kv in a.cross_check:
            cross_check(kv, a)
        if a.ours:
            run_ours(a.ours, a)
    from benchmarks.lib.smollm2_llama_cpp_report import write_report

    write_report(TYPES, Path(a.results))
    print(f"wrote {a.results}/smollm2_llama_cpp.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

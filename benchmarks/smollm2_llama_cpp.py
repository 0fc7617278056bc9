"""SmolLM2-135M-Instruct with llama.cpp's KV cache types (``-ctk`` / ``-ctv``: ``q8_0``, ``q4_0``, ``q4_1``,
``iq4_nl``; ``f16`` the baseline) as rows of our tables: protocol P, the task suite, its cache bytes per token —
beside our stacks' figures from ``results/`` (the same windows and seeds).

    python -m benchmarks.smollm2_llama_cpp                       # perplexity + the reduced task set, every type
    python -m benchmarks.smollm2_llama_cpp --types q8_0 q4_0     # some types
    python -m benchmarks.smollm2_llama_cpp --ours k8v4h int4h    # + our stacks on protocol P (loads the model)
    python -m benchmarks.smollm2_llama_cpp --types --tasks --exact-bytes --cross-check q8_0 f16
                      # bytes at 2^15 cells (exact in llama.cpp's log); llama-perplexity itself beside our API path
    python -m benchmarks.smollm2_llama_cpp --report-only --resume --force   # the report from what is finished

``--resume`` keeps the finished rows. llama.cpp: its C API (``$KVSPLICE_LLAMA_CPP``), flash attention on (V is
quantised only with it).
"""

from __future__ import annotations

from benchmarks.harness import report
from benchmarks.harness.options import UsageError
from benchmarks.harness.paths import EVAL as STORIES, SMOLLM2 as MODEL
from benchmarks.harness.runner import Study
from benchmarks.lib import smollm2_llama_cpp as lib


def options(ap) -> None:
    ap.add_argument("--types", nargs="*", default=lib.TYPES, help="llama.cpp cache types, K and V both (default: all)")
    ap.add_argument("--no-perplexity", dest="perplexity", action="store_false", help="skip protocol P")
    ap.add_argument("--tasks", nargs="*", default=lib.TASKS, help="suite tasks (none: no task rows)")
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024])
    ap.add_argument("--n", type=int, default=8, help="instances per task and length, seeds 0..n-1 (default 8)")
    ap.add_argument("--settings", nargs="+", default=["agnostic"], choices=("agnostic", "aware"))
    ap.add_argument("--ours", nargs="*", default=[], help="our method specs to run on protocol P too (loads the model)")
    ap.add_argument("--cross-check", nargs="*", default=[], metavar="TYPE", help="llama-perplexity beside our API path")
    ap.add_argument("--exact-bytes", action="store_true", help="cache bytes at 2^15 cells (exact in its log)")
    ap.add_argument("--report-only", action="store_true", help="the report from --resume's JSON; measure nothing")


def rows(run):
    """The resumed rows, then per type its cache, protocol P and answers; the exact bytes, the cross-checks, ours."""
    from types import SimpleNamespace

    import benchmarks.lib.smollm2_windows as C
    from kvsplice.convert.engines.kv_types import kv_type
    from kvsplice.convert.engines.llama_cpp import LlamaCppModel, missing

    a = run.args
    try:
        for t in a.types + a.cross_check:
            kv_type(t)
    except ValueError as e:
        raise UsageError(str(e)) from None
    yield from run.done
    if a.report_only or not (a.types or a.cross_check or a.ours):
        return
    why = missing(converter=False, bindings=True) if a.types or a.cross_check else None
    gguf = next(MODEL.glob("*.gguf"), None)
    if not gguf or why:
        raise UsageError(why or f"no GGUF under {MODEL}")
    from kvsplice.loading import load_tokenizer
    from kvsplice.tasks.suite import make_instances

    tok = load_tokenizer(MODEL)
    windows = C.eval_windows(SimpleNamespace(tokenizer=tok))  # protocol P's (4, 1024) ids: only the tokenizer
    insts = make_instances(a.tasks, tok, a.lengths, a.n, stories=str(STORIES)) if a.tasks and a.types else []
    run.say(f"windows {tuple(windows.shape)}, {len(insts)} instances")
    for kv in a.types:
        yield from lib.type_rows(kv, run, tok, windows, insts)
    for kv in a.types if a.exact_bytes else []:  # at 2^15 cells llama.cpp's MiB (2 decimals) are exact for SmolLM2
        if not run.previous(kind="cache", type=kv, cells=32768):
            with LlamaCppModel(gguf, n_ctx=32768, n_batch=32, cache_type=kv, flash_attn=True) as lm:
                yield lib.cache_row(lm, kv)
    for kv in a.cross_check:
        if not run.previous(kind="cross_check", type=kv):
            yield lib.cross_check(kv, a.threads)
    yield from lib.ours_rows([s for s in a.ours if not run.previous(kind="ours", spec=s)], windows)


def summary(run, rows) -> dict:
    """Protocol P's table and each setting's task accuracy; the report's rows (``section``: P, cross_check, tasks)."""
    cache = sorted((r for r in rows if r["kind"] == "cache"), key=lambda r: r["cells"])
    cache = {r["type"]: r for r in cache}  # each type's of most cells (2^15 with --exact-bytes: exact)
    p, tasks = lib.p_table(rows, cache), lib.task_tables(rows, cache)
    run.notes["report"] = [dict(r, section="P") for r in p]
    run.notes["report"] += [dict(r, section="cross_check") for r in rows if r["kind"] == "cross_check"]
    for s, engines in tasks.items():  # a row per setting and engine / method, most bytes first
        for name, e in sorted(engines.items(), key=lambda x: -x[1].get("bytes_per_token", 0)):
            each = ", ".join(f"{c}: {a:.0f} ({n})" for c, (a, n) in sorted(e["cells"].items()))
            run.notes["report"].append(dict(e, section="tasks", setting=s, engine=name, each=each))
    return {"protocol_P": p, "tasks": tasks}


STUDY = Study("smollm2_llama_cpp", __doc__, rows, options=options, summary=summary,
              markdown=lambda run, rows: report.markdown(STUDY.spec("report"), run.notes["report"]))
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())

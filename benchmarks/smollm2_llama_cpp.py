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

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional


from benchmarks.harness.options import add_progress, add_threads, command, parser
from benchmarks.harness.paths import EVAL as STORIES, RESULTS, ROOT, SMOLLM2 as MODEL

WORK = ROOT / "checkpoints" / "smollm2_llama_cpp"
TYPES = ["f16", "q8_0", "q4_0", "q4_1", "iq4_nl"]
TASKS = ["passkey", "niah_number_stories", "niah_word_facts"]  # the reduced table's (results/smollm2_tasks.md)
PROMPT, N_CTX_SLACK = 768, 64
# our rows on protocol P, read from the results files (the same 4 windows): (results file, row id, label)
OURS_P = [("smollm2_frontier.json", "full", "ours: full K/V, fp32 model"),
          ("smollm2_frontier.json", "int8", "ours: int8 rows"),
          ("smollm2_frontier.json", "kivi4_r128", "ours: KIVI-4 (g32, last 128 fp16)"),
          ("smollm2_frontier.json", "kivi4_r32", "ours: KIVI-4 (g32, last 32 fp16)"),
          ("smollm2_frontier.json", "hf_quanto_int4", "transformers QuantizedCache quanto int4"),
          ("smollm2_frontier.json", "obs_x1.55_kivi4_r32", "ours: ObservedAttention ×1.55 + KIVI-4 (r32)"),
          ("smollm2_frontier.json", "plan_4x", "ours: perplexity planner 4× (ObservedAttention ×2.1 + int8)"),
          ("smollm2_tasks_goals.json", "4x", "ours: planner 4× pick (KVzip band ×1.69 + k8v4h)"),
          ("smollm2_frontier.json", "plan_8x", "ours: perplexity planner 8× (ObservedAttention ×4.2 + int8)"),
          ("smollm2_tasks_goals.json", "8x", "ours: planner 8× pick (KVzip pooled ×3.38 + k8v4h)")]
OURS_TASKS_RUN = WORK / "ours_tasks_1024.json"
OURS_TASKS_CMD = ("kvsplice eval-tasks --model ../shared/data/smollm2-135m-instruct --stories "
                  "../shared/data/tinystories/yuninxia_moe-routing-bench__tinystories_val.txt --method k8v4h int4 "
                  "--tasks passkey niah_number_stories niah_word_facts --lengths 1024 --n 8 --setting agnostic "
                  "--threads 1 --out checkpoints/smollm2_llama_cpp/ours_tasks_1024.json")
OURS_TASKS = {"full": "ours: full K/V", "int8": "ours: int8 rows", "kivi4": "ours: KIVI-4 (r128)",
              "plan4x.json": "ours: planner 4× pick", "plan8x.json": "ours: planner 8× pick"}  # a plan: by file name


# ------------------------------------------------------------------------------------------------ work files
def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _save(path: Path, doc: dict) -> None:
    from models.checkpoint import atomic_write

    atomic_write(path, lambda p: p.write_text(json.dumps(doc, indent=1) + "\n"))


def _windows(tokenizer):
    """Protocol P's (4, 1024) windows with ``tokenizer`` (``benchmarks.lib.smollm2_windows``; only the tokenizer)."""
    from types import SimpleNamespace

    import benchmarks.lib.smollm2_windows as C

    return C.eval_windows(SimpleNamespace(tokenizer=tokenizer))


# ------------------------------------------------------------------------------------------------ llama.cpp rows
def run_type(kv: str, a, tokenizer, windows, insts) -> None:
    """Protocol P and the task instances in cache type ``kv`` (K and V), resuming ``WORK/<kv>.json``."""
    from tqdm.auto import tqdm

    from kvsplice.convert.engines.kv_types import kv_bytes_per_token
    from kvsplice.convert.engines.llama_cpp import LlamaCppModel
    from benchmarks.lib.llama_cpp_eval import answer, protocol_p

    path = WORK / f"{kv}.json"
    doc = _load(path)
    doc.setdefault("tasks", {})
    gguf = next(MODEL.glob("*.gguf"))
    todo = [(i, s) for i in insts for s in a.settings if f"{i.key}/{s}" not in doc["tasks"]]
    need_ppl = a.perplexity and "protocol_P" not in doc
    n_ctx = max([windows.shape[1]] + [i.length + i.max_new_tokens + N_CTX_SLACK for i in insts])
    bar = tqdm(total=len(windows) * need_ppl + len(todo), desc=kv, unit="run", disable=not a.progress)
    with LlamaCppModel(gguf, n_ctx=n_ctx, cache_type=kv, flash_attn=True, threads=a.threads) as lm:
        cache = lm.kv_cache()
        doc["kv_cache"] = {**cache, "bytes_per_token": lm.kv_bytes_per_token,
                           "formula_bytes_per_token": kv_bytes_per_token(30, 3, 64, 64, kv, kv)}
        if need_ppl:
            doc["protocol_P"] = protocol_p(lm, windows.tolist(), prompt_len=PROMPT, progress=bar.update)
            _save(path, doc)
        for inst, setting in todo:
            doc["tasks"][f"{inst.key}/{setting}"] = answer(lm, tokenizer, inst, setting=setting)
            _save(path, doc)
            bar.update()
    bar.close()
    _save(path, doc)


def run_ours(specs: list[str], a) -> None:
    """Our ``specs`` (``kvsplice.build_method``) on protocol P, resuming ``WORK/ours.json`` (loads the fp32 model)."""
    import torch

    import benchmarks.lib.smollm2_windows as C
    from kvsplice import build_method
    from kvsplice.loading import load_tokenizer
    from kvsplice.evaluation.protocol import evaluate, evaluate_each

    path = WORK / "ours.json"
    doc = _load(path)
    specs = [s for s in specs if s not in doc]
    if not specs:
        return
    torch.set_num_threads(a.threads)
    loaded = C.load()
    windows = C.eval_windows(loaded)
    same = torch.equal(windows, _windows(load_tokenizer(MODEL)))
    for spec in specs:  # window by window, each method built from its prompt (KVzip re-reads it)
        if spec == "full":
            r = evaluate(loaded.model, None, windows, prompt_len=PROMPT, batch_size=1)
        else:
            r = evaluate_each(loaded.model, lambda ids: build_method(spec, prompt_ids=ids, tokenizer=loaded.tokenizer),
                              windows, prompt_len=PROMPT)
        doc[spec] = {**r, "windows_equal_llama_cpp_ids": same}
        doc[spec].pop("measured", None)
        _save(path, doc)
        print(f"ours {spec}: ppl {doc[spec]['ppl']:.4f}, {doc[spec]['bytes_per_token']:.0f} B/token", flush=True)


def exact_bytes(types: list[str], cells: int = 32768) -> dict[str, Any]:
    """The cache llama.cpp allocates per token for each type, read from its log at ``cells`` cells (2^15: its MiB,
    printed to 2 decimals, are then exact for SmolLM2's rows), beside ggml's closed form. ``WORK/bytes.json``."""
    from kvsplice.convert.engines.kv_types import kv_bytes_per_token
    from kvsplice.convert.engines.llama_cpp import LlamaCppModel

    path = WORK / "bytes.json"
    doc = _load(path)
    gguf = next(MODEL.glob("*.gguf"))
    for kv in types:
        if kv not in doc:
            with LlamaCppModel(gguf, n_ctx=cells, n_batch=32, cache_type=kv, flash_attn=True) as lm:
                doc[kv] = {**lm.kv_cache(), "bytes_per_token": lm.kv_bytes_per_token,
                           "formula_bytes_per_token": kv_bytes_per_token(30, 3, 64, 64, kv, kv)}
            _save(path, doc)
    return doc


def cross_check(kv: str, a, chunks: int = 2, n_ctx: int = 1024) -> dict[str, Any]:
    """``llama-perplexity -ctk KV -ctv KV -fa on`` on the validation text (its own protocol: chunks of ``n_ctx``
    tokens of llama.cpp's tokenisation, the second half scored) beside the same chunks scored through our C API path
    (:meth:`LlamaCppModel.continuation_nll` with the first ``n_ctx / 2 + 1`` tokens as the prompt): the bindings and
    the tool should agree. Kept in ``WORK/cross_check.json``."""
    import re
    import subprocess

    from kvsplice.convert.engines.llama_cpp import LlamaCppModel, binary

    path = WORK / "cross_check.json"
    doc = _load(path)
    if kv in doc:
        return doc[kv]
    gguf = next(MODEL.glob("*.gguf"))
    cmd = [str(binary("llama-perplexity")), "-m", str(gguf), "-f", str(STORIES), "-c", str(n_ctx), "-b", str(n_ctx),
           "--chunks", str(chunks), "-t", str(a.threads), "-fa", "on", "-ctk", kv, "-ctv", kv, "--no-repack"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", r.stdout + r.stderr)
    if m is None:
        raise RuntimeError(f"llama-perplexity failed (exit {r.returncode}): {(r.stderr or r.stdout)[-400:]}")
    tool_s = time.perf_counter() - t0
    first = n_ctx // 2
    with LlamaCppModel(gguf, n_ctx=n_ctx, cache_type=kv, flash_attn=True, threads=a.threads) as lm:
        ids = lm.tokenize(STORIES.read_text(encoding="utf-8"), add_special=True)  # as the tool
        bos = lm.ll.llama_vocab_bos(lm.vocab) if lm.ll.llama_vocab_get_add_bos(lm.vocab) else None
        nll, n = 0.0, 0
        for c in range(chunks):
            w = ids[c * n_ctx:(c + 1) * n_ctx]
            if bos is not None:
                w = [bos] + w[1:]
            x, k = lm.continuation_nll(w, first + 1, chunk=n_ctx)
            nll, n = nll + x, n + k
    doc[kv] = {"command": " ".join(cmd), "llama_perplexity": float(m[1]), "pm": float(m[2]), "tool_seconds": tool_s,
               "api": math.exp(nll / n), "scored_tokens": n, "chunks": chunks, "n_ctx": n_ctx}
    _save(path, doc)
    print(f"cross-check {kv}: llama-perplexity {doc[kv]['llama_perplexity']:.4f}, API {doc[kv]['api']:.4f}", flush=True)
    return doc[kv]


# ------------------------------------------------------------------------------------------------ the report
def _pct(x: float, ref: float) -> str:
    return f"{100 * (x / ref - 1):+.2f} %"


def our_p_rows() -> list[dict]:
    """Our protocol P rows from the results files and ``WORK/ours.json``: label, ppl, bytes per token."""
    rows = []
    for fname, rid, label in OURS_P:
        doc = _load(RESULTS / fname)
        r = doc.get("rows", {}).get(rid) if "rows" in doc else doc.get("plans", {}).get(rid, {}).get("protocol_P")
        if r:
            rows.append({"label": label, "ppl": r["ppl"], "bytes_per_token": r["bytes_per_token"],
                         "source": f"results/{fname} → {rid}"})
    for spec, r in _load(WORK / "ours.json").items():
        rows.append({"label": f"ours: {spec}", "ppl": r["ppl"], "bytes_per_token": r["bytes_per_token"],
                     "source": f"this benchmark, --ours {spec}"})
    return rows


def _task_summary(results: dict, setting: str) -> dict[str, Any]:
    cells: dict[str, list[float]] = {}
    for r in results.values():
        if r["setting"] == setting:
            cells.setdefault(f"{r['task']}/{r['length']}", []).append(r["score"])
    acc = {c: (100 * sum(v) / len(v), len(v)) for c, v in sorted(cells.items())}
    allv = [s for v in cells.values() for s in v]
    cpu = sum(r["cpu_seconds"] for r in results.values() if r["setting"] == setting)
    return {"cells": acc, "acc": 100 * sum(allv) / len(allv) if allv else None, "n": len(allv),
            "cpu_seconds": cpu / max(len(allv), 1)}


def write_report(types: list[str], results_dir: Path) -> dict:
    from models.checkpoint import atomic_write

    docs = {kv: _load(WORK / f"{kv}.json") for kv in types}
    docs = {kv: d for kv, d in docs.items() if d}
    ours = our_p_rows()
    full_ours = next((r["ppl"] for r in ours if r["label"].startswith("ours: full")), None)
    f16 = docs.get("f16", {}).get("protocol_P", {}).get("ppl")
    md = ["# llama.cpp's KV cache types beside our stacks (SmolLM2-135M-Instruct)", "",
          "`python -m benchmarks.smollm2_llama_cpp` — llama.cpp 0.3.36 (llama-cpp-python's vendored tree) "
          "through its C API on the shared Q4_1 GGUF, our tokenizer's ids, K and V in the type, flash attention on, "
          "one thread; protocol P (4 validation windows of 1,024 tokens, 768 prefilled, 256 decoded in chunks of 64 "
          "and scored). Bytes per token: llama.cpp's own log line at context creation (K + V MiB over its cells) "
          "and ggml's closed form beside it; ours: each method's closed form at fp16 storage per prompt token "
          "(results/).", "",
          "## Protocol P", "",
          "| engine / cache | bytes / token | × smaller than fp16 | ppl | vs llama.cpp f16 | vs our full (fp32) |",
          "|---|---:|---:|---:|---:|---:|"]
    rows = []
    exact = _load(WORK / "bytes.json")  # at 2^15 cells: exact; else the run's own context (log rounding)
    for kv, d in docs.items():
        d["bytes"] = exact.get(kv, d["kv_cache"])
        if "protocol_P" in d:
            rows.append({"label": f"llama.cpp `{kv}` K+V", "ppl": d["protocol_P"]["ppl"],
                         "bytes_per_token": d["bytes"]["bytes_per_token"],
                         "formula": d["bytes"]["formula_bytes_per_token"], "cells": d["bytes"]["cells"]})
    rows += ours
    for r in sorted(rows, key=lambda r: -r["bytes_per_token"]):
        b = f"{r['bytes_per_token']:,.0f}"
        if "formula" in r:  # llama.cpp's log over its cells, against ggml's closed form
            b = f"{b} (= formula)" if r["bytes_per_token"] == r["formula"] else \
                f"{r['bytes_per_token']:,.1f} (log at {r['cells']:,} cells; formula {r['formula']:,})"
        md.append(f"| {r['label']} | {b} | {23040 / r['bytes_per_token']:.2f} | {r['ppl']:.4f} | "
                  f"{_pct(r['ppl'], f16) if f16 else ''} | {_pct(r['ppl'], full_ours) if full_ours else ''} |")
    report: dict[str, Any] = {"protocol_P": rows, "llama_cpp": docs, "tasks": {}}
    cc = _load(WORK / "cross_check.json")
    if cc:
        report["cross_check"] = cc
        md += ["", "Cross-check, llama.cpp's own tool against the C API path above (its protocol: chunks of 1,024 "
               "tokens of llama.cpp's tokenisation, the second half scored):", "",
               "| cache | `llama-perplexity` | C API, same chunks | command |", "|---|---:|---:|---|"]
        for kv, r in cc.items():
            tool = (f"llama-perplexity -m GGUF -f VAL -c {r['n_ctx']} -b {r['n_ctx']} --chunks {r['chunks']} -fa on "
                    f"-ctk {kv} -ctv {kv} --no-repack")
            md.append(f"| `{kv}` | {r['llama_perplexity']:.4f} ± {r['pm']:.4f} | {r['api']:.4f} | `{tool}` |")
    settings = sorted({r["setting"] for d in docs.values() for r in d.get("tasks", {}).values()})
    ours_t = _load(RESULTS / "smollm2_tasks.json").get("by_length", {})
    extra = _load(OURS_TASKS_RUN)  # our stacks at llama.cpp's bytes, run by OURS_TASKS_CMD on the same instances
    if extra:
        from kvsplice.tasks.report import summarize

        extra_summary = summarize(extra["results"], list(extra["methods"]))
    for s in settings:
        summ = {f"llama.cpp `{kv}`": _task_summary(d["tasks"], s) for kv, d in docs.items() if d.get("tasks")}
        for m, r in ours_t.get("1024", {}).get("summary", {}).get(s, {}).items():
            label = OURS_TASKS.get(m if not m.startswith("plan:") else Path(m).name)
            if label:
                summ[label] = {"cells": {c: (v["acc"], v["n"]) for c, v in r["cells"].items()}, "acc": r["acc"],
                               "n": r["n"], "bytes_per_token": r["bytes_per_token_fp16"]}
        for m, r in (extra_summary.get(s, {}) if extra else {}).items():
            if m != "full":
                summ[f"ours: {m}"] = {"cells": {c: (v["acc"], v["n"]) for c, v in r["cells"].items()},
                                      "acc": r["acc"], "n": r["n"], "bytes_per_token": r["bytes_per_token_fp16"]}
        for kv, d in docs.items():
            if f"llama.cpp `{kv}`" in summ:
                summ[f"llama.cpp `{kv}`"]["bytes_per_token"] = d["bytes"]["bytes_per_token"]
        report["tasks"][s] = summ
        cells = sorted({c for v in summ.values() for c in v["cells"]})
        names = sorted(summ, key=lambda k: -summ[k].get("bytes_per_token", 0))
        md += ["", f"## Tasks, query-{s} (accuracy %, n per cell in brackets)", "",
               "| task | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for c in cells:
            md.append(f"| {c} | " + " | ".join(
                f"{summ[n]['cells'][c][0]:.0f} ({summ[n]['cells'][c][1]})" if c in summ[n]["cells"] else ""
                for n in names) + " |")
        md.append("| **mean** | " + " | ".join(f"**{summ[n]['acc']:.1f}**" for n in names) + " |")
        md.append("| bytes / token | " + " | ".join(f"{summ[n].get('bytes_per_token', 0):,.0f}" for n in names) + " |")
    results_dir.mkdir(parents=True, exist_ok=True)
    stem = results_dir / "smollm2_llama_cpp"
    atomic_write(stem.with_suffix(".json"), lambda p: p.write_text(json.dumps(report, indent=1) + "\n"))
    atomic_write(stem.with_suffix(".md"), lambda p: p.write_text("\n".join(md) + "\n"))
    return report


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
    write_report(TYPES, Path(a.results))
    print(f"wrote {a.results}/smollm2_llama_cpp.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

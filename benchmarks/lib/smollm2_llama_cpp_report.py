"""The report of ``benchmarks/smollm2_llama_cpp.py``: llama.cpp's cache types beside our rows from ``results/``
(protocol P perplexity, the tasks' accuracy, cache bytes per token), as ``results/smollm2_llama_cpp.{json,md}``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.harness.paths import RESULTS
from benchmarks.lib.smollm2_llama_cpp_runs import OURS_P, OURS_TASKS, OURS_TASKS_RUN, WORK, _load


def _pct(x: float, ref: float) -> str:
    return f"{100 * (x / ref - 1):+.2f} %"


def our_p_rows() -> list[dict]:
    """Our protocol P rows from the results files and ``WORK/ours.json``: label, ppl, bytes per token."""
    rows = []
    for fname, rid, label in OURS_P:
        doc = _load(RESULTS / fname)
        r = next((x for x in doc.get("rows", []) if x["id"] == rid), None) if "rows" in doc else \
            doc.get("plans", {}).get(rid, {}).get("protocol_P")
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

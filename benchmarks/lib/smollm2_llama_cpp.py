"""The rows and report of ``benchmarks/smollm2_llama_cpp.py``: llama.cpp's cache types on protocol P and the task
instances, the cache it allocates per token, llama-perplexity itself beside the C API path and our stacks on protocol
P; the tables beside our rows from ``results/``."""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.paths import EVAL as STORIES, RESULTS, ROOT, SMOLLM2 as MODEL
from benchmarks.lib.llama_cpp_eval import answer, protocol_p
from kvsplice.convert.engines.kv_types import kv_bytes_per_token
from kvsplice.convert.engines.llama_cpp import LlamaCppModel, binary

TYPES = ["f16", "q8_0", "q4_0", "q4_1", "iq4_nl"]
TASKS = ["passkey", "niah_number_stories", "niah_word_facts"]  # the reduced table's (results/smollm2_tasks.md)
PROMPT, N_CTX_SLACK, FULL = 768, 64, 23040
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
OURS_TASKS_RUN = ROOT / "checkpoints" / "smollm2_llama_cpp" / "ours_tasks_1024.json"
OURS_TASKS_CMD = ("kvsplice eval-tasks --model ../shared/data/smollm2-135m-instruct --stories "
                  "../shared/data/tinystories/yuninxia_moe-routing-bench__tinystories_val.txt --method k8v4h int4 "
                  "--tasks passkey niah_number_stories niah_word_facts --lengths 1024 --n 8 --setting agnostic "
                  "--threads 1 --out checkpoints/smollm2_llama_cpp/ours_tasks_1024.json")
OURS_TASKS = {"full": "ours: full K/V", "int8": "ours: int8 rows", "kivi4": "ours: KIVI-4 (r128)",
              "plan4x.json": "ours: planner 4× pick", "plan8x.json": "ours: planner 8× pick"}  # a plan: by file name


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def cache_row(lm: LlamaCppModel, kv: str) -> dict[str, Any]:
    """The cache llama.cpp allocated per token (its log over its cells) beside ggml's closed form."""
    return {"kind": "cache", "type": kv, **lm.kv_cache(), "bytes_per_token": lm.kv_bytes_per_token,
            "formula_bytes_per_token": kv_bytes_per_token(30, 3, 64, 64, kv, kv)}


def type_rows(kv: str, run, tokenizer, windows, insts):
    """Cache type ``kv`` (K and V): its cache row, protocol P and each instance in each setting not yet done."""
    todo = [(i, s) for i in insts for s in run.args.settings if not run.previous(type=kv, id=f"{i.key}/{s}")]
    need_ppl = run.args.perplexity and not run.previous(kind="P", type=kv)
    if not todo and not need_ppl:
        return
    n_ctx = max([windows.shape[1]] + [i.length + i.max_new_tokens + N_CTX_SLACK for i in insts])
    with LlamaCppModel(next(MODEL.glob("*.gguf")), n_ctx=n_ctx, cache_type=kv, flash_attn=True,
                       threads=run.args.threads) as lm:
        if not run.previous(kind="cache", type=kv, cells=lm.kv_cache()["cells"]):
            yield cache_row(lm, kv)
        if need_ppl:
            yield {"kind": "P", "type": kv, **protocol_p(lm, windows.tolist(), prompt_len=PROMPT)}
        for inst, setting in todo:
            yield {"kind": "task", "id": f"{inst.key}/{setting}", **answer(lm, tokenizer, inst, setting=setting),
                   "type": kv}


def exact_bytes(kv: str, cells: int = 32768) -> dict[str, Any]:
    """The cache row at ``cells`` cells (2^15: llama.cpp's MiB, printed to 2 decimals, are exact for SmolLM2)."""
    with LlamaCppModel(next(MODEL.glob("*.gguf")), n_ctx=cells, n_batch=32, cache_type=kv, flash_attn=True) as lm:
        return cache_row(lm, kv)


def cross_check(kv: str, threads: int, chunks: int = 2, n_ctx: int = 1024) -> dict[str, Any]:
    """``llama-perplexity -ctk KV -ctv KV -fa on`` on the validation text (its own protocol: chunks of ``n_ctx``
    tokens of llama.cpp's tokenisation, the second half scored) beside the same chunks scored through our C API path
    (:meth:`LlamaCppModel.continuation_nll`, the first ``n_ctx / 2 + 1`` tokens as the prompt): they should agree."""
    gguf = next(MODEL.glob("*.gguf"))
    cmd = [str(binary("llama-perplexity")), "-m", str(gguf), "-f", str(STORIES), "-c", str(n_ctx), "-b", str(n_ctx),
           "--chunks", str(chunks), "-t", str(threads), "-fa", "on", "-ctk", kv, "-ctv", kv, "--no-repack"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", r.stdout + r.stderr)
    if m is None:
        raise RuntimeError(f"llama-perplexity failed (exit {r.returncode}): {(r.stderr or r.stdout)[-400:]}")
    tool_s, nll, n = time.perf_counter() - t0, 0.0, 0
    with LlamaCppModel(gguf, n_ctx=n_ctx, cache_type=kv, flash_attn=True, threads=threads) as lm:
        ids = lm.tokenize(STORIES.read_text(encoding="utf-8"), add_special=True)  # as the tool
        bos = lm.ll.llama_vocab_bos(lm.vocab) if lm.ll.llama_vocab_get_add_bos(lm.vocab) else None
        for c in range(chunks):
            w = ids[c * n_ctx:(c + 1) * n_ctx]
            x, k = lm.continuation_nll(w if bos is None else [bos] + w[1:], n_ctx // 2 + 1, chunk=n_ctx)
            nll, n = nll + x, n + k
    return {"kind": "cross_check", "type": kv, "command": " ".join(cmd), "llama_perplexity": float(m[1]),
            "pm": float(m[2]), "tool_seconds": tool_s, "api": math.exp(nll / n), "scored_tokens": n,
            "chunks": chunks, "n_ctx": n_ctx}


def ours_rows(specs: list[str], windows_ids):
    """Our ``specs`` (``kvsplice.build_method``) on protocol P, window by window (KVzip re-reads each prompt)."""
    import benchmarks.lib.smollm2_windows as C
    from kvsplice import build_method
    from kvsplice.evaluation.protocol import evaluate, evaluate_each

    if not specs:
        return
    loaded = C.load()
    windows = C.eval_windows(loaded)
    for spec in specs:
        if spec == "full":
            r = evaluate(loaded.model, None, windows, prompt_len=PROMPT, batch_size=1)
        else:
            r = evaluate_each(loaded.model, lambda ids: build_method(spec, prompt_ids=ids, tokenizer=loaded.tokenizer),
                              windows, prompt_len=PROMPT)
        r.pop("measured", None)
        yield {"kind": "ours", "spec": spec, **r, "windows_equal_llama_cpp_ids": bool((windows == windows_ids).all())}


def caches(rows: list[dict]) -> dict[str, dict]:
    """Each type's cache row of most cells (2^15 with ``--exact-bytes``: exact; else the run's, log rounding)."""
    return {r["type"]: r for r in sorted((r for r in rows if r["kind"] == "cache"), key=lambda r: r["cells"])}


def p_table(rows: list[dict], cache: dict) -> list[dict]:
    """Protocol P: llama.cpp's types, our rows from ``results/`` and ours (``--ours``), most bytes first."""
    out = [{"label": f"llama.cpp `{r['type']}` K+V", "ppl": r["ppl"], "bytes_per_token": c["bytes_per_token"],
            "formula": c["formula_bytes_per_token"], "cells": c["cells"]}
           for r in rows if r["kind"] == "P" for c in [cache[r["type"]]]]
    for fname, rid, label in OURS_P:
        doc = _load(RESULTS / fname)
        r = next((x for x in doc["rows"] if x["id"] == rid), None) if "rows" in doc else \
            doc.get("plans", {}).get(rid, {}).get("protocol_P")
        if r:
            out.append({"label": label, "ppl": r["ppl"], "bytes_per_token": r["bytes_per_token"]})
    out += [{"label": f"ours: {r['spec']}", "ppl": r["ppl"], "bytes_per_token": r["bytes_per_token"]}
            for r in rows if r["kind"] == "ours"]
    return sorted(out, key=lambda r: -r["bytes_per_token"])


def task_tables(rows: list[dict], cache: dict) -> dict[str, dict]:
    """Per setting, per engine / method: accuracy per task/length cell ``(%, n)``, the mean, bytes per token."""
    from kvsplice.tasks.report import summarize

    out: dict[str, dict] = {}
    for r in rows:
        if r["kind"] == "task":
            e = out.setdefault(r["setting"], {}).setdefault(f"llama.cpp `{r['type']}`", {"scores": {}, "cells": {}})
            e["scores"].setdefault(f"{r['task']}/{r['length']}", []).append(r["score"])
            e["bytes_per_token"] = cache[r["type"]]["bytes_per_token"]
    ours = _load(RESULTS / "smollm2_tasks.json").get("by_length", {}).get("1024", {}).get("summary", {})
    extra = _load(OURS_TASKS_RUN)  # our stacks at llama.cpp's bytes, run by OURS_TASKS_CMD on the same instances
    extra = summarize(extra["results"], list(extra["methods"])) if extra else {}
    for s, summ in out.items():
        for e in summ.values():
            e["cells"] = {c: (100 * sum(v) / len(v), len(v)) for c, v in sorted(e.pop("scores").items())}
            e["n"] = sum(n for _, n in e["cells"].values())
            e["acc"] = sum(a * n for a, n in e["cells"].values()) / e["n"]
        labelled = [(OURS_TASKS.get(Path(m).name if m.startswith("plan:") else m), r)
                    for m, r in ours.get(s, {}).items()]
        labelled += [(f"ours: {m}", r) for m, r in extra.get(s, {}).items() if m != "full"]
        for label, r in labelled:
            if label:
                summ[label] = {"cells": {c: (v["acc"], v["n"]) for c, v in r["cells"].items()}, "acc": r["acc"],
                               "n": r["n"], "bytes_per_token": r["bytes_per_token_fp16"]}
    return out

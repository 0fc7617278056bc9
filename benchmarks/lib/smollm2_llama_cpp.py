"""``smollm2_llama_cpp``'s rows: llama.cpp's cache types on protocol P and the tasks (our ids, our scoring), its cache
per token, llama-perplexity beside the C API path, our stacks; the tables beside our rows from ``results/``."""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

from benchmarks.harness.paths import EVAL as STORIES, RESULTS, ROOT, SMOLLM2 as MODEL
from benchmarks.harness.studies import load as load_study
from kvsplice.convert.engines.kv_types import kv_bytes_per_token
from kvsplice.convert.engines.llama_cpp import LlamaCppModel, binary

TYPES = ["f16", "q8_0", "q4_0", "q4_1", "iq4_nl"]
TASKS = ["passkey", "niah_number_stories", "niah_word_facts"]  # the reduced table's (results/smollm2_tasks.md)
PROMPT, N_CTX_SLACK, FULL = 768, 64, 23040
OURS = load_study("smollm2_llama_cpp")
OURS_TASKS_RUN = ROOT / OURS["ours_tasks_cmd"].split()[-1]  # our stacks at llama.cpp's bytes (its --out)


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def protocol_p(lm: LlamaCppModel, windows: Sequence[Sequence[int]], *, prompt_len: int = 768,
               chunk: int = 64) -> dict[str, Any]:
    """Pooled perplexity of the continuations of ``windows`` (N, T) after ``prompt_len`` tokens, in ``lm``'s cache."""
    t0, c0 = time.perf_counter(), time.process_time()
    per = [lm.continuation_nll([int(t) for t in w], prompt_len, chunk) for w in windows]  # (nll, scored) a window
    scored = sum(n for _, n in per)
    nll = sum(x for x, _ in per) / max(scored, 1)
    return {"ppl": math.exp(nll), "nll": nll, "scored_tokens": scored, "windows": len(per),
            "window": len(windows[0]) if len(windows) else 0, "prompt_len": prompt_len,
            "ppl_per_window": [math.exp(x / n) for x, n in per], "seconds": time.perf_counter() - t0,
            "cpu_seconds": time.process_time() - c0}


def answer(lm: LlamaCppModel, tokenizer, inst, *, setting: str = "agnostic") -> dict[str, Any]:
    """``inst`` answered greedily by ``lm`` in ``setting`` and scored as the suite scores it (llama.cpp reads every
    K / V row as stored, as our storage methods do: the settings differ only in how the ids are batched)."""
    from kvsplice.tasks.instance import prompt_ids
    from kvsplice.tasks.runner import decode_text

    ctx, q = prompt_ids(tokenizer, inst)
    first, then = (ctx + q, []) if setting == "aware" else (ctx, q)
    if len(ctx) + len(q) + inst.max_new_tokens > lm.n_ctx:
        raise ValueError(f"{inst.key}: {len(ctx) + len(q)} prompt + {inst.max_new_tokens} new tokens exceed "
                         f"n_ctx = {lm.n_ctx}")
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = lm.greedy(first, inst.max_new_tokens, then=then, eos=tokenizer.eos_id)
    if tokens and tokens[-1] == tokenizer.eos_id:
        tokens = tokens[:-1]
    text = decode_text(tokenizer, tokens)
    return {"key": inst.key, "task": inst.task, "length": inst.length, "setting": setting,
            "type_k": lm.type_k, "type_v": lm.type_v, "score": inst.score(text), "output": text, "tokens": tokens,
            "n_prompt": len(ctx) + len(q), "seconds": time.perf_counter() - t0,
            "cpu_seconds": time.process_time() - c0}


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


def cross_check(kv: str, threads: int, chunks: int = 2, n_ctx: int = 1024) -> dict[str, Any]:
    """``llama-perplexity -ctk KV -ctv KV -fa on`` on the validation text (chunks of ``n_ctx`` tokens, the second
    half scored) beside the same chunks through :meth:`LlamaCppModel.continuation_nll`: they should agree."""
    gguf = next(MODEL.glob("*.gguf"))
    cmd = [str(binary("llama-perplexity")), "-m", str(gguf), "-f", str(STORIES), "-c", str(n_ctx), "-b", str(n_ctx),
           "--chunks", str(chunks), "-t", str(threads), "-fa", "on", "-ctk", kv, "-ctv", kv, "--no-repack"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", r.stdout + r.stderr)
    if m is None:
        raise RuntimeError(f"llama-perplexity failed (exit {r.returncode}): {(r.stderr or r.stdout)[-400:]}")
    tool_s = time.perf_counter() - t0
    with LlamaCppModel(gguf, n_ctx=n_ctx, cache_type=kv, flash_attn=True, threads=threads) as lm:
        ids = lm.tokenize(STORIES.read_text(encoding="utf-8"), add_special=True)  # as the tool, each chunk from BOS
        bos = [lm.ll.llama_vocab_bos(lm.vocab)] if lm.ll.llama_vocab_get_add_bos(lm.vocab) else []
        api = protocol_p(lm, [bos + ids[c * n_ctx + len(bos):(c + 1) * n_ctx] for c in range(chunks)],
                         prompt_len=n_ctx // 2 + 1, chunk=n_ctx)
    return {"kind": "cross_check", "type": kv, "command": " ".join(cmd), "llama_perplexity": float(m[1]),
            "pm": float(m[2]), "tool_seconds": tool_s, "api": api["ppl"], "scored_tokens": api["scored_tokens"],
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


def p_table(rows: list[dict], cache: dict) -> list[dict]:
    """Protocol P: llama.cpp's types, our rows from ``results/`` and ours (``--ours``), most bytes first; each with
    its ratio to fp16's bytes and its perplexity against llama.cpp's f16 and our full cache."""
    out = [{"label": f"llama.cpp `{r['type']}` K+V", "ppl": r["ppl"], "bytes_per_token": c["bytes_per_token"],
            "formula": c["formula_bytes_per_token"], "cells": c["cells"]}
           for r in rows if r["kind"] == "P" for c in [cache[r["type"]]]]
    for fname, rid, label in OURS["ours_p"]:
        doc = _load(RESULTS / fname)
        r = next((x for x in doc["rows"] if x["id"] == rid), None) if "rows" in doc else \
            doc.get("plans", {}).get(rid, {}).get("protocol_P")
        if r:
            out.append({"label": label, "ppl": r["ppl"], "bytes_per_token": r["bytes_per_token"]})
    out += [{"label": f"ours: {r['spec']}", "ppl": r["ppl"], "bytes_per_token": r["bytes_per_token"]}
            for r in rows if r["kind"] == "ours"]
    f16 = next((r["ppl"] for r in out if r["label"] == "llama.cpp `f16` K+V"), None)
    full = next((r["ppl"] for r in out if r["label"].startswith("ours: full")), None)
    for r in out:  # the fp16 cache over its bytes; perplexity against llama.cpp's f16 and our full cache, in %
        r.update(smaller=FULL / r["bytes_per_token"], vs_f16=f16 and 100 * (r["ppl"] / f16 - 1),
                 vs_full=full and 100 * (r["ppl"] / full - 1))
        if "formula" in r:
            r["exact"] = r["bytes_per_token"] == r["formula"]
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
    extra = _load(OURS_TASKS_RUN)  # run by the YAML's ours_tasks_cmd on the same instances
    extra = summarize(extra["results"], list(extra["methods"])) if extra else {}
    for s, summ in out.items():
        for e in summ.values():
            e["cells"] = {c: (100 * sum(v) / len(v), len(v)) for c, v in sorted(e.pop("scores").items())}
            e["n"] = sum(n for _, n in e["cells"].values())
            e["acc"] = sum(a * n for a, n in e["cells"].values()) / e["n"]
        labelled = [(OURS["ours_tasks"].get(Path(m).name if m.startswith("plan:") else m), r)
                    for m, r in ours.get(s, {}).items()]
        labelled += [(f"ours: {m}", r) for m, r in extra.get(s, {}).items() if m != "full"]
        for label, r in labelled:
            if label:
                summ[label] = {"cells": {c: (v["acc"], v["n"]) for c, v in r["cells"].items()}, "acc": r["acc"],
                               "n": r["n"], "bytes_per_token": r["bytes_per_token_fp16"]}
    return out

"""The runs of ``benchmarks/smollm2_llama_cpp.py``: its settings, llama.cpp's cache types on protocol P and the task
instances (resumable work files under ``WORK``), our stacks on protocol P, the exact bytes at 2^15 cells and
llama-perplexity itself beside the API path."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.paths import EVAL as STORIES, ROOT, SMOLLM2 as MODEL

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

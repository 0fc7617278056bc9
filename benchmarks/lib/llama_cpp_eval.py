"""Protocol P's perplexity and the task suite's answers run inside llama.cpp, so that its own KV cache types
(``q8_0``, ``q4_0``, ...) stand in the same tables as our methods, on the same token ids (ours, fed as ids).

* :func:`protocol_p`: each window as :func:`kvsplice.evaluation.protocol.evaluate` scores it: ``prompt_len`` tokens
  prefilled in one batch, the rest decoded teacher-forced in chunks, the continuation scored.
* :func:`answer`: a task instance answered greedily with the suite's ids, settings and stop rule, scored by the
  instance's own ``score`` on the text our tokenizer decodes, as :func:`kvsplice.tasks.runner.answer` does.

llama.cpp stores every K and V row in the cache type as it enters and every attention (the prompt's prefill
included) reads it as stored, as our storage methods (``int8``, ``k8v4h``) do: for these rows the settings differ
only in how the ids are split into batches (aware: one prefill; agnostic: the context, then the question).
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

from kvsplice.convert.engines.llama_cpp import LlamaCppModel

__all__ = ["answer", "protocol_p"]


def protocol_p(lm: LlamaCppModel, windows: Sequence[Sequence[int]], *, prompt_len: int = 768, chunk: int = 64,
               progress=None) -> dict[str, Any]:
    """Perplexity of the continuations of ``windows`` (``(N, T)`` ids) after ``prompt_len`` prompt tokens, pooled
    over the windows, in ``lm``'s cache types; ``progress()`` after each window."""
    total, scored, t0, c0 = 0.0, 0, time.perf_counter(), time.process_time()
    per_window = []
    for w in windows:
        ids = [int(t) for t in w]
        nll, n = lm.continuation_nll(ids, prompt_len, chunk)
        total, scored = total + nll, scored + n
        per_window.append(math.exp(nll / n))
        if progress is not None:
            progress()
    nll = total / max(scored, 1)
    return {"ppl": math.exp(nll), "nll": nll, "scored_tokens": scored, "windows": len(per_window),
            "window": len(windows[0]) if len(windows) else 0, "prompt_len": prompt_len, "ppl_per_window": per_window,
            "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}


def answer(lm: LlamaCppModel, tokenizer, inst, *, setting: str = "agnostic") -> dict[str, Any]:
    """``inst`` answered greedily by ``lm`` in ``setting`` and scored as the suite scores it."""
    from kvsplice.tasks.instance import SETTINGS, prompt_ids
    from kvsplice.tasks.runner import decode_text

    if setting not in SETTINGS:
        raise ValueError(f"setting must be one of {SETTINGS}, got {setting!r}")
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

"""Prefill (+ compression) time of a plan or method inside transformers, beside the full cache's plain prefill.

::

    python benchmarks/prefill_speed.py --methods full plan:checkpoints/prefill/plan4x.json \
        --lengths 2048 8192 --repeats 3 --json prefill.json

One ``model(prompt, past_key_values=cache)`` per method and repeat — ``DynamicCache`` for ``full``, else a
``KVSpliceHFCache`` over the method built for the prompt (KVzip re-reads it) —, the methods interleaved within each
repeat, on a prompt of the validation text's first ``L`` tokens. Reported per length: the median wall and process-CPU
seconds over the repeats and each method's ratio to ``full`` (wall; the CPU ratio beside it is robust to other
processes on a shared machine). Timings only: nothing is asserted.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

if __name__ == "__main__" and not __package__:  # run as a file: the repository first on sys.path (benchmarks/_root.py)
    import _root  # noqa: F401

from benchmarks.harness.header import header  # noqa: E402
from benchmarks.harness.options import add_json, add_model, add_threads, command, parser  # noqa: E402
from benchmarks.harness.paths import EVAL, SMOLLM2  # noqa: E402

FULL = "full"
PLAN_PREFIX = "plan:"


def method_for(name: str, ids: torch.Tensor, tokenizer):
    """The method ``name`` (``full``, ``plan:PATH`` or a spec) built for the prompt ``ids (1, P)``."""
    from kvsplice.core.build import build_method
    from kvsplice.planning.spec import Plan

    if name.startswith(PLAN_PREFIX):
        return Plan.load(name[len(PLAN_PREFIX):]).method(ids.shape[1], prompt_ids=ids, tokenizer=tokenizer)
    return build_method(name, prompt_len=ids.shape[1], prompt_ids=ids, tokenizer=tokenizer)


def one_prefill(model, name: str, ids: torch.Tensor, tokenizer) -> tuple[float, float]:
    """``(wall, process CPU)`` seconds of one prefill (+ compression) of ``ids`` with ``name``'s cache."""
    from transformers import DynamicCache

    from kvsplice.hf.base import KVSpliceHFCache

    t0, c0 = time.perf_counter(), time.process_time()
    cache = DynamicCache() if name == FULL else KVSpliceHFCache(model, method_for(name, ids, tokenizer))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t0, time.process_time() - c0


@command
def main(argv=None) -> int:
    ap = parser(__file__, __doc__)
    add_model(ap, SMOLLM2)
    ap.add_argument("--text", default=str(EVAL), help="prompt text (default: the TinyStories validation sample)")
    ap.add_argument("--methods", nargs="+", default=[FULL])
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048])
    ap.add_argument("--repeats", type=int, default=3)
    add_threads(ap, 2)
    add_json(ap, help="write the medians here")
    a = ap.parse_args(argv)
    from kvsplice.loading import load_model
    from kvsplice.loading import iter_texts, token_stream

    torch.set_num_threads(a.threads)
    loaded = load_model(a.model)
    model, tok = loaded.model, loaded.tokenizer
    model.eval()
    stream, _ = token_stream(iter_texts(a.text), tok, max(a.lengths))
    methods = [FULL, *(m for m in a.methods if m != FULL)]
    report: dict = {**header(__file__, argv, a.threads), "model": a.model, "threads": a.threads, "repeats": a.repeats, "lengths": {}}
    for length in a.lengths:
        ids = stream[:length].reshape(1, -1)
        runs: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
        for r in range(a.repeats):
            for m in methods:
                runs[m].append(one_prefill(model, m, ids, tok))
                print(f"L={length} repeat {r} {m}: {runs[m][-1][0]:.2f} s wall, {runs[m][-1][1]:.2f} s CPU",
                      flush=True)
        med = {m: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for m, v in runs.items()}
        rows = {m: {"wall_s": w, "cpu_s": c, "ratio_wall": w / med[FULL][0], "ratio_cpu": c / med[FULL][1],
                    "runs": runs[m]} for m, (w, c) in med.items()}
        report["lengths"][str(length)] = rows
        for m, row in rows.items():
            print(f"L={length} {m}: median {row['wall_s']:.2f} s wall ({row['ratio_wall']:.2f}x full), "
                  f"{row['cpu_s']:.2f} s CPU ({row['ratio_cpu']:.2f}x)", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Prefill (+ compression) time of a plan or method inside transformers, beside the full cache's plain prefill.

::

    python -m benchmarks.prefill_speed --methods full plan:checkpoints/prefill/plan4x.json \
        --lengths 2048 8192 --repeats 3 --out prefill

One ``model(prompt, past_key_values=cache)`` per method and repeat — ``DynamicCache`` for ``full``, else a
``KVSpliceHFCache`` over the method built for the prompt (KVzip re-reads it) —, the methods interleaved within each
repeat, on a prompt of the validation text's first ``L`` tokens. A row per length and method: the median wall and
process-CPU seconds over the repeats and the ratio to ``full`` (wall; the CPU ratio beside it is robust to other
processes on a shared machine). Timings only: nothing is asserted.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.harness.options import add_model
from benchmarks.harness.paths import EVAL, SMOLLM2
from benchmarks.harness.runner import Study

FULL = "full"
PLAN_PREFIX = "plan:"


def method_for(name: str, ids, tokenizer):
    """The method ``name`` (``full``, ``plan:PATH`` or a spec) built for the prompt ``ids (1, P)``."""
    from kvsplice.core.build import build_method
    from kvsplice.planning.spec import Plan

    if name.startswith(PLAN_PREFIX):
        return Plan.load(name[len(PLAN_PREFIX):]).method(ids.shape[1], prompt_ids=ids, tokenizer=tokenizer)
    return build_method(name, prompt_len=ids.shape[1], prompt_ids=ids, tokenizer=tokenizer)


def one_prefill(model, name: str, ids, tokenizer) -> tuple[float, float]:
    """``(wall, process CPU)`` seconds of one prefill (+ compression) of ``ids`` with ``name``'s cache."""
    import torch

    from benchmarks.lib.speed import prefill_and_steps

    t0, c0 = time.perf_counter(), time.process_time()
    method = None if name == FULL else method_for(name, ids, tokenizer)
    with torch.no_grad():
        prefill_and_steps(model, "hf", method, ids, ids.shape[1])[0]()
    return time.perf_counter() - t0, time.process_time() - c0


def options(p) -> None:
    add_model(p, SMOLLM2)
    p.add_argument("--text", default=str(EVAL), help="prompt text (default: the TinyStories validation sample)")
    p.add_argument("--methods", nargs="+", help="methods beside full (specs or plan:PATH)")
    p.add_argument("--lengths", nargs="+", type=int, help="prompt lengths in tokens")
    p.add_argument("--repeats", type=int, help="prefills per method and length")


def rows(run):
    from kvsplice.loading import iter_texts, load_model, token_stream

    loaded = load_model(run.args.model)
    model, tok = loaded.model.eval(), loaded.tokenizer
    stream, _ = token_stream(iter_texts(run.args.text), tok, max(run["lengths"]))
    methods = [FULL, *(m for m in run["methods"] if m != FULL)]
    for length in run["lengths"]:
        if all(run.previous(length=length, method=m) for m in methods):
            yield from (run.previous(length=length, method=m) for m in methods)
            continue
        ids = stream[:length].reshape(1, -1)
        runs: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
        for r in range(run["repeats"]):
            for m in methods:
                runs[m].append(one_prefill(model, m, ids, tok))
                run.say(f"L={length} repeat {r} {m}: {runs[m][-1][0]:.2f} s wall, {runs[m][-1][1]:.2f} s CPU")
        med = {m: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for m, v in runs.items()}
        for m, (w, c) in med.items():
            row = {"length": length, "method": m, "wall_s": w, "cpu_s": c, "ratio_wall": w / med[FULL][0],
                   "ratio_cpu": c / med[FULL][1], "runs": runs[m]}
            run.say(f"L={length} {m}: median {w:.2f} s wall ({row['ratio_wall']:.2f}x full), "
                    f"{c:.2f} s CPU ({row['ratio_cpu']:.2f}x)")
            yield row


STUDY = Study("prefill_speed", __doc__, rows, options=options, threads=2,
              bounds={"lengths": (1, 1 << 17), "repeats": (1, 1000)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())

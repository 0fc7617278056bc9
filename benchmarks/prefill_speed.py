"""Prefill (+ compression) time of a plan or method inside transformers, beside the full cache's plain prefill.

    python -m benchmarks.prefill_speed --methods full plan:checkpoints/prefill/plan4x.json \
        --lengths 2048 8192 --repeats 3 --out prefill

One ``model(prompt, past_key_values=cache)`` per method and repeat (``DynamicCache`` for ``full``, else a
``KVSpliceHFCache`` over the method built for the prompt), the methods interleaved, on the validation text's first
``L`` tokens. A row per length and method: median wall and process-CPU seconds and their ratios to ``full``.
"""

from __future__ import annotations

import time

import torch

from benchmarks.harness.options import add_model
from benchmarks.harness.paths import EVAL, SMOLLM2
from benchmarks.harness.runner import Study
from benchmarks.lib.speed import interleaved, prefill_and_steps
from kvsplice.loading import iter_texts, load_model, token_stream
from kvsplice.tasks.methods import parse_method


def options(p) -> None:
    add_model(p, SMOLLM2)
    p.add_argument("--text", default=str(EVAL), help="prompt text (default: the TinyStories validation sample)")
    p.add_argument("--methods", nargs="+", help="methods beside full (specs or plan:PATH)")
    p.add_argument("--lengths", nargs="+", type=int, help="prompt lengths in tokens")
    p.add_argument("--repeats", type=int, help="prefills per method and length")


def rows(run):
    loaded = load_model(run.args.model)
    model, tok = loaded.model.eval(), loaded.tokenizer
    stream, _ = token_stream(iter_texts(run.args.text), tok, max(run["lengths"]))
    methods = ["full", *(m for m in run["methods"] if m != "full")]
    factories = {m: parse_method(m, tok, model).factory for m in methods}
    for length in run["lengths"]:
        if all(run.previous(length=length, method=m) for m in methods):
            yield from (run.previous(length=length, method=m) for m in methods)
            continue
        ids = stream[:length].reshape(1, -1)

        def one(m: str) -> tuple[float, float]:  # (wall, process CPU) seconds of a prefill (+ compression)
            t0, c0 = time.perf_counter(), time.process_time()
            with torch.no_grad():
                prefill_and_steps(model, "hf", factories[m](ids), ids, length)[0]()
            w, c = time.perf_counter() - t0, time.process_time() - c0
            run.say(f"L={length} {m}: {w:.2f} s wall, {c:.2f} s CPU")
            return w, c

        runs, med = interleaved(methods, run["repeats"], one)  # med[m]: [wall, CPU]
        for m, (w, c) in med.items():
            row = {"length": length, "method": m, "wall_s": w, "cpu_s": c, "ratio_wall": w / med["full"][0],
                   "ratio_cpu": c / med["full"][1], "runs": runs[m]}
            run.say(f"L={length} {m}: median {w:.2f} s wall ({row['ratio_wall']:.2f}x full), "
                    f"{c:.2f} s CPU ({row['ratio_cpu']:.2f}x)")
            yield row


STUDY = Study("prefill_speed", __doc__, rows, options=options, threads=2,
              bounds={"lengths": (1, 1 << 17), "repeats": (1, 1000)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())

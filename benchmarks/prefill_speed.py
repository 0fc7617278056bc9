"""Prefill (+ compression) time of a plan or method inside transformers, beside the full cache's plain prefill.

    python -m benchmarks.prefill_speed --methods full plan:checkpoints/prefill/plan4x.json \
        --lengths 2048 8192 --repeats 3 --out prefill

One ``model(prompt, past_key_values=cache)`` per method and repeat (``DynamicCache`` for ``full``, else a
``KVSpliceHFCache`` over the method built for the prompt), the methods interleaved, on the validation text's first
``L`` tokens. A row per length and method: median wall and process-CPU seconds and their ratios to ``full``.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.harness.options import add_model
from benchmarks.harness.paths import EVAL, SMOLLM2
from benchmarks.harness.runner import Study


def one_prefill(model, factory, ids) -> tuple[float, float]:
    """``(wall, process CPU)`` seconds of one prefill (+ compression) of ``ids`` with the cache ``factory`` builds
    for them (:func:`kvsplice.tasks.methods.parse_method`: None for the full cache)."""
    import torch

    from benchmarks.lib.speed import prefill_and_steps

    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        prefill_and_steps(model, "hf", factory(ids), ids, ids.shape[1])[0]()
    return time.perf_counter() - t0, time.process_time() - c0


def options(p) -> None:
    add_model(p, SMOLLM2)
    p.add_argument("--text", default=str(EVAL), help="prompt text (default: the TinyStories validation sample)")
    p.add_argument("--methods", nargs="+", help="methods beside full (specs or plan:PATH)")
    p.add_argument("--lengths", nargs="+", type=int, help="prompt lengths in tokens")
    p.add_argument("--repeats", type=int, help="prefills per method and length")


def rows(run):
    from kvsplice.loading import iter_texts, load_model, token_stream
    from kvsplice.tasks.methods import parse_method

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
        runs: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
        for r in range(run["repeats"]):
            for m in methods:
                runs[m].append(one_prefill(model, factories[m], ids))
                run.say(f"L={length} repeat {r} {m}: {runs[m][-1][0]:.2f} s wall, {runs[m][-1][1]:.2f} s CPU")
        med = {m: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for m, v in runs.items()}
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

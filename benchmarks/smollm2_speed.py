"""SmolLM2-135M-Instruct: prefill (+ compression) and per-token decode of the compressed caches beside the full
cache, in both doors, at long contexts → ``results/smollm2_speed[_<tag>].{json,md,png}``.

    taskset -c 0 python -m benchmarks.smollm2_speed --contexts 2048 8000 --batch 1 --doors hf decoder
    python -m benchmarks.smollm2_speed --quick            # 512 tokens, batch 1 and 2, fp32, both doors: minutes
    python -m benchmarks.smollm2_speed --model M --smoke --out /tmp/x/speed      # any model

Methods (``--methods``: ``kvsplice.build_method`` specs, ``full`` = the uncompressed cache; the default and the
planner's 4× / 8× picks ``pick4x`` / ``pick8x`` in the YAML, or ``--plan4`` / ``--plan8``): per (dtype, context,
batch, door) each prefilled once (TinyStories validation text, a slice per sequence), then its decode steps timed
round-robin (:mod:`benchmarks.lib.speed`); one torch thread by default (thread-CPU seconds: robust when shared).
"""

from __future__ import annotations

import itertools

import torch

from benchmarks.harness.options import UsageError, add_model
from benchmarks.harness.paths import EVAL, SMOLLM2
from benchmarks.harness.runner import Study
from benchmarks.harness.studies import load as load_study
from benchmarks.lib.speed import measure, method_factories, prompt_ids

# the planner's default picks (docs/tasks.md) when no plan file is given; --methods' default
PICKS, METHODS = (load_study("smollm2_speed")[k] for k in ("picks", "methods"))


def options(p) -> None:
    add_model(p, SMOLLM2)
    p.add_argument("--data", default=str(EVAL), help="prompt text")
    p.add_argument("--methods", nargs="+", default=METHODS)
    p.add_argument("--plan4", help="the 4x plan (JSON); default: the pick's spec (pick4x)")
    p.add_argument("--plan8", help="the 8x plan (JSON); default: the pick's spec (pick8x)")
    p.add_argument("--contexts", nargs="+", type=int, help="prompt tokens (+ decode steps ≤ the model's positions)")
    p.add_argument("--batch", nargs="+", type=int, help="sequences per batch")
    p.add_argument("--dtype", nargs="+", choices=["fp32", "bf16"], default=["fp32"])
    p.add_argument("--doors", nargs="+", choices=["hf", "decoder"], default=["hf", "decoder"])
    p.add_argument("--rounds", type=int, help="decode steps per method (round-robin)")
    p.add_argument("--pick-scores", choices=["kvzip", "random"], default="kvzip",
                   help="random: the KVzip stacks keep tokens by random scores instead of the reconstruction pass "
                        "(the same cache layout and sizes, so the same decode cost; their prefill is then not KVzip's)")
    p.add_argument("--quick", dest="size", action="store_const", const="quick", default="default",
                   help="the quick size: 512 tokens, batch 1 and 2, 4 rounds: a few minutes")


def rows(run):
    from kvsplice.loading import load_model  # (looked up at run time: the tests replace it)

    args = run.args
    for dt in args.dtype:
        lm = load_model(args.model, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dt])
        model, tok = lm.model, lm.tokenizer
        limit = getattr(model.config, "max_position_embeddings", None)
        too_long = [t for t in run["contexts"] if limit is not None and t + run["rounds"] + 2 > limit]
        if too_long:  # refused before any work, not after the first door's prefills
            raise UsageError(f"--contexts {too_long} + {run['rounds'] + 2} decode steps exceed the model's "
                             f"{limit} positions")
        methods = method_factories(args, model, tok, PICKS)
        for t, b in itertools.product(run["contexts"], run["batch"]):
            ids = prompt_ids(tok, args.data, t, b)
            for door in args.doors:
                for r in measure(model, door, methods, ids, rounds=run["rounds"]):
                    run.say(f"{dt} T={t} B={b} {door:7s} {r['method']:8s} prefill {r['prefill_s']:7.2f}s decode "
                            f"{r['decode_ms']:8.1f} ms ×{r['decode_vs_full']:.2f} (wall ×{r['decode_wall_vs_full']:.2f})")
                    yield {**r, "dtype": dt}


STUDY = Study("smollm2_speed", __doc__, rows, options=options,
              summary=lambda run, rows: {"picks": {k: (getattr(run.args, "plan" + k[4]) or v) for k, v in PICKS.items()},
                                         "pick_scores": run.args.pick_scores},
              bounds={"contexts": (2, 1 << 17), "batch": (1, 256), "rounds": (1, 1000)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())

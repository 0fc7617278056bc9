"""The stack on a real pretrained model: token subset → low-rank coefficients → int8, on stories260K, in both doors.

    python -m benchmarks.stack_stories260k      # → results/stack_stories260k.json + .md (a few minutes, 1 CPU thread)

``gqa-concat`` post-RoPE bases (calibrated on the train sample) at every ``--ranks``; per validation window the
prompt prefilled, the continuation fed teacher-forced and scored. Methods: the full cache (fp32, int8), low rank
alone (fp32, int8), BalanceKV alone at every ``--budgets`` and the stack ``TokenSelection(balancekv, budget,
store=LowRank(bases, cache_quant="int8"))`` at every budget × rank, each through the ``Decoder`` and through
transformers' forward (the HF door): both perplexities must agree, and the measured bytes equal the formula.
"""

from __future__ import annotations

from benchmarks.harness.options import add_windows
from benchmarks.harness.paths import CALIB, EVAL
from benchmarks.harness.runner import Study
from benchmarks.lib.stories import calibration_ids, load_stories, windows as text_windows
from benchmarks.lib.doors import evaluate
from kvsplice import build_method
from kvsplice.lowrank import calibrate, calibration_batches, fit_bases


def methods(bases: dict[int, object], budgets: list[int], selector: str) -> dict[str, tuple[dict, object]]:
    """name → (description, method) for every configuration of the study, each built from its spec
    (:func:`kvsplice.build_method`; a fresh selector per method: its own random stream)."""
    lowrank = lambda b, quant=None: {"name": "lowrank", "bases": b, "cache_quant": quant}  # noqa: E731
    select = lambda n, store: {"name": "token_selection", "selector": {"name": selector}, "budget": n,  # noqa: E731
                               "store": store}
    specs = {"full": ({"kind": "full", "quant": None}, "dense"),
             "full-int8": ({"kind": "full", "quant": "int8"}, "int8")}
    for r, b in bases.items():
        specs[f"lowrank-r{r}"] = ({"kind": "lowrank", "rank": r, "quant": None}, lowrank(b))
        specs[f"lowrank-r{r}-int8"] = ({"kind": "lowrank", "rank": r, "quant": "int8"}, lowrank(b, "int8"))
    for n in budgets:
        specs[f"select-b{n}"] = ({"kind": "select", "budget": n, "quant": None}, select(n, "dense"))
        for r, b in bases.items():
            specs[f"stack-b{n}-r{r}-int8"] = ({"kind": "stack", "budget": n, "rank": r, "quant": "int8"},
                                              select(n, lowrank(b, "int8")))
    return {name: (desc, build_method(spec)) for name, (desc, spec) in specs.items()}


def options(p) -> None:
    p.add_argument("--calib-tokens", dest="calib_tokens", type=int, help="calibration tokens")
    add_windows(p, data=False)
    p.add_argument("--ranks", type=int, nargs="+", help="ranks of the bases")
    p.add_argument("--budgets", type=int, nargs="+", help="tokens kept of the prompt")
    p.add_argument("--selector", default="balancekv", help="the token selector")


def rows(run):
    loaded = load_stories(need=(CALIB, EVAL))
    stats = calibrate(loaded.model, calibration_batches(calibration_ids(loaded, run["calib_tokens"]), 512, 8),
                      rope="post", progress=False)
    run.notes["calib_tokens"] = stats.n_tokens
    bases = {r: fit_bases(stats, "gqa-concat", rank=r) for r in run["ranks"]}
    windows, _ = text_windows(loaded, EVAL, run["prompt"] + run["cont"], run["windows"], split="validation")
    full = None
    for name, (desc, method) in methods(bases, run["budgets"], run.args.selector).items():
        row = {**evaluate(loaded.model, windows, run["prompt"], name, method), **desc}
        full = full or row
        row.update(delta_pct=100 * (row["ppl"] / full["ppl"] - 1), x_full_fp32=full["bytes"] / row["bytes"])
        run.say(f"{name:24s} ppl {row['ppl']:.4f} (hf {row['ppl_hf']:.4f})  {row['bytes_per_token']:7.1f} B/token "
                f"({row['ratio_vs_fp16_full']:.2f}x vs fp16)  bytes==formula {row['bytes_match']}")
        yield row
    checks = {"bytes_match_all": all(r["bytes_match"] for r in run.rows),
              "ppl_door_max_rel": max(abs(r["ppl_hf"] / r["ppl"] - 1) for r in run.rows)}
    run.notes.update(checks, checks=checks, selector=run.args.selector, tokens_seen=full["tokens_seen"])
    if not checks["bytes_match_all"] or checks["ppl_door_max_rel"] >= 1e-4:
        run.fail(f"the doors disagree: {checks}")

STUDY = Study("stack_stories260k", __doc__, rows, options=options,
              summary=lambda run, rows: {"calibration": {"source": CALIB.name, "tokens": run.notes["calib_tokens"]},
                                         "checks": run.notes["checks"]},
              bounds={"calib_tokens": (512, 1 << 22), "windows": (1, 4096), "prompt": (1, 512), "cont": (1, 512),
                      "ranks": (1, 8), "budgets": (1, 512)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())

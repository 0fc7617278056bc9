"""SmolLM2-135M-Instruct: prefill (+ compression) and per-token decode of the compressed caches beside the full
cache, in both doors, at long contexts → ``results/smollm2_speed[_<tag>].{json,md,png}``.

    taskset -c 0 python -m benchmarks.smollm2_speed --contexts 2048 8000 --batch 1 --doors hf decoder
    python -m benchmarks.smollm2_speed --quick            # 512 tokens, batch 1 and 2, fp32, both doors: minutes
    python -m benchmarks.smollm2_speed --model M --contexts 64 --rounds 2 --out-dir /tmp/x   # any model

Methods (``--methods``, any ``kvsplice.build_method`` spec, ``full`` = the uncompressed cache): by default the full
cache, ``int8``, ``kivi4``, ``k8v4h`` and the planner's default 4× and 8× picks — from ``--plan4`` / ``--plan8``
(plans made by ``python -m kvsplice.plan ... --ratio 4|8``) or, without them, their specs as docs/tasks.md records
them (``pick4x`` / ``pick8x`` below). Per (dtype, context, batch, door) every method is prefilled once (the
prompt: TinyStories validation text, a different slice per sequence of the batch) and its decode steps are timed
round-robin with the others (:mod:`benchmarks.lib.speed`): ratios are medians measured side by side. One torch
thread by default (``--threads``): times are thread-CPU seconds, robust to other processes on a shared machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


from benchmarks.harness.header import command as command_line, machine_line, revision
from benchmarks.harness.options import add_model, add_out, add_threads, command, parser
from benchmarks.harness.paths import EVAL, RESULTS, SMOLLM2
from benchmarks.harness.results import result_stem, write_markdown, write_result

PICKS = {  # the planner's default picks on SmolLM2-135M-Instruct (docs/tasks.md), when no plan file is given
    "pick4x": "select:kvzip(mix=observed_attention,share=0.1,heads=pooled,layers=50%-67%,decoded=int8)@x1.69+k8v4h",
    "pick8x": "select:kvzip(mix=observed_attention,share=0.1,heads=pooled,decoded=int8)@x3.38+k8v4h",
}
DEFAULT_METHODS = ["full", "int8", "kivi4", "k8v4h", "pick4x", "pick8x"]


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__file__, __doc__, raw=True)
    add_model(p, SMOLLM2)
    p.add_argument("--data", default=str(EVAL), help="prompt text")
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS)
    p.add_argument("--plan4", help="the 4x plan (JSON); default: the pick's spec (pick4x)")
    p.add_argument("--plan8", help="the 8x plan (JSON); default: the pick's spec (pick8x)")
    p.add_argument("--contexts", nargs="+", type=int, default=[2048, 8000],
                   help="prompt tokens (+ the decode steps: within the model's positions)")
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    p.add_argument("--dtype", nargs="+", choices=["fp32", "bf16"], default=["fp32"])
    p.add_argument("--doors", nargs="+", choices=["hf", "decoder"], default=["hf", "decoder"])
    p.add_argument("--rounds", type=int, default=8, help="decode steps per method (round-robin)")
    add_threads(p)
    p.add_argument("--pick-scores", choices=["kvzip", "random"], default="kvzip",
                   help="random: the KVzip stacks keep tokens by random scores instead of the reconstruction pass "
                        "(the same cache layout and sizes, so the same decode cost; their prefill is then not KVzip's)")
    p.add_argument("--quick", action="store_true", help="512 tokens, batch 1 and 2, 4 rounds: a few minutes")
    p.add_argument("--tag", default="", help="results/smollm2_speed_<tag>.*")
    add_out(p, RESULTS, "the results folder", flag="--out-dir")
    a = p.parse_args(argv)
    if a.quick:
        a.contexts, a.batch, a.rounds = [512], [1, 2], 4
    return a


def method_factories(args, model, tok):
    """``[(label, method | None | ids → method)]``: the full cache is ``None``; a plan or a KVzip spec is built per
    prompt (it re-reads it)."""
    from kvsplice.core.registry import build_method, needs_prompt
    from kvsplice.planning.spec import Plan

    out = []
    for name in args.methods:
        if name == "full":
            out.append(("full", None))
            continue
        plan_path = {"pick4x": args.plan4, "pick8x": args.plan8}.get(name)
        if plan_path:
            plan = Plan.load(plan_path, model)
            out.append((name, lambda ids, plan=plan: plan.method(ids.shape[1], prompt_ids=ids, tokenizer=tok)))
            continue
        spec = PICKS.get(name, name)
        if needs_prompt(spec) or spec.startswith("select:"):
            out.append((name, lambda ids, spec=spec: _scored(build_method(spec, prompt_len=ids.shape[1],
                                                                          prompt_ids=ids, tokenizer=tok),
                                                             model, ids, args.pick_scores)))
        else:
            out.append((name, build_method(spec)))
    return out


def _scored(method, model, ids: torch.Tensor, scores: str):
    """``method``, a KVzip selection given random token scores (``scores="random"``: its ``shared_scores``, so no
    reconstruction pass runs) — the decode-time layout of the stack without the cost of its prefill."""
    if scores == "random" and hasattr(method, "shared_scores"):
        cfg = model.config
        g = torch.Generator().manual_seed(0)
        method.shared_scores = {l: torch.rand(ids.shape[0], cfg.num_key_value_heads, ids.shape[1], generator=g)
                                for l in range(cfg.num_hidden_layers)}
    return method


def prompt_ids(tok, path: str, t: int, b: int) -> torch.Tensor:
    """``(b, t)`` token ids: consecutive ``t``-token slices of the text."""
    ids = tok.encode(Path(path).read_text())
    need = t * b
    while len(ids) < need:
        ids = ids + ids
    return torch.tensor(ids[:need]).view(b, t)


def write_report(rows: list[dict], out: Path, meta: dict) -> None:
    write_result(out, {"meta": meta, "rows": rows})
    head = ("| dtype | context | batch | door | method | prefill s | ×full | decode ms/token | ×full (CPU) | ×full (wall) "
            "| cache MiB | prefill peak RSS MiB |")
    lines = [f"# SmolLM2-135M-Instruct: decode speed of compressed caches\n", f"`{meta['command']}`\n",
             f"{meta['machine']}\n", head, "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['context']} | {r['batch']} | {r['door']} | {r['method']} | "
                     f"{r['prefill_s']:.2f} | {r['prefill_vs_full']:.2f} | {r['decode_ms']:.1f} | "
                     f"**{r['decode_vs_full']:.2f}** | {r['decode_wall_vs_full']:.2f} | "
                     f"{r['cache_bytes'] / 2**20:.1f} | {r['prefill_peak_rss_bytes'] / 2**20:.0f} |")
    write_markdown(out, "\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        groups = sorted({(r["dtype"], r["door"], r["batch"]) for r in rows})
        fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4), squeeze=False)
        for ax, (dt, door, b) in zip(axes[0], groups):
            rs = [r for r in rows if (r["dtype"], r["door"], r["batch"]) == (dt, door, b)]
            for m in dict.fromkeys(r["method"] for r in rs):
                pts = sorted((r["context"], r["decode_vs_full"]) for r in rs if r["method"] == m)
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=m)
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{door}, batch {b}, {dt}", fontsize=9)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("decode per token / full cache")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=110)
    except ImportError:
        pass


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvsplice.loading import load_model
    from benchmarks.lib.speed import measure

    rows = []
    for dt in args.dtype:
        lm = load_model(args.model, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dt])
        model, tok = lm.model, lm.tokenizer
        limit = getattr(model.config, "max_position_embeddings", None)
        too_long = [t for t in args.contexts if limit is not None and t + args.rounds + 2 > limit]
        if too_long:  # refused before any work, not after the first door's prefills
            raise SystemExit(f"smollm2_speed: --contexts {too_long} + {args.rounds + 2} decode steps exceed the model's "
                             f"{limit} positions")
        methods = method_factories(args, model, tok)
        for t in args.contexts:
            for b in args.batch:
                ids = prompt_ids(tok, args.data, t, b)
                for door in args.doors:
                    for r in measure(model, door, methods, ids, rounds=args.rounds):
                        r["dtype"] = dt
                        rows.append(r)
                        print(f"{dt} T={t} B={b} {door:7s} {r['method']:8s} prefill {r['prefill_s']:7.2f}s "
                              f"decode {r['decode_ms']:8.1f} ms ×{r['decode_vs_full']:.2f} (wall ×"
                              f"{r['decode_wall_vs_full']:.2f})", flush=True)
                    write_report(rows, result_stem("smollm2_speed", args.tag, args.out_dir), _meta(args, argv))
    return 0


def _meta(args, argv) -> dict:
    return {"command": command_line(__file__, argv), "revision": revision(),
            "machine": machine_line(args.threads) + " at the end (a shared machine: times are thread-CPU, ratios "
                       "side by side)",
            "picks": {k: (getattr(args, "plan" + k[4]) or v) for k, v in PICKS.items()},
            "pick_scores": args.pick_scores}


if __name__ == "__main__":
    sys.exit(main())

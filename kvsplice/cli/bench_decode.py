"""Per-token decode step time at a fixed context length: MHA vs MLA (naive / absorbed) vs MLA + KVSplice.

    kvsplice bench-decode --ctx 512 2048 8192 --batch 8 --json results/bench_decode.json
    kvsplice bench-decode --config gpt2 mla:naive mla_kvsplice_90 --ctx 1024 4096 --threads 1

Each variant is built at its config's shapes (default: the 124M presets, random weights, eval mode) with
``block_size`` raised to the largest context + 1. For every context ``T`` a cache with ``capacity=T+1`` is filled
with ``T`` tokens by ``cache.append(layer, ...)`` of random values — **timing only**: no real prefill, and every
layer holds the same random block (the values do not change the amount of work). Then single-token steps
``model(tok, cache=cache)`` are timed (each attends over ``T + 1`` keys) and ``cache.truncate(T)`` rolls the step
back so the context stays fixed. Reported: the median step time over ``--repeats`` timed steps (after
``--warmup``), and each variant's speed-up over MHA measured in the same run.

Noise control on a shared machine: the timed steps of every (variant, context) are split over ``--rounds``
rounds; every round visits every context (direction alternating) and every variant (order rotated), so all cells
sample the same stretches of background load, and both the ratios to MHA and each variant's growth with context
compare like with like. Only one cache is alive at a time (the MHA cache at 8192 tokens, batch 8, fp32 is 4.8 GB).
On a busy machine ``--threads 1`` gives steadier numbers: with several threads every op waits at an OpenMP
barrier for whichever thread the OS descheduled, which inflates small ops by orders of magnitude.

Variants: ``--config NAME[:naive|:absorb][:int8][:sdpa|:kernel][:graph]`` (preset or LightningCLI YAML, as for
``verify_memory``); MLA configs use ``cfg.mla_impl`` unless a suffix says otherwise; ``:int8`` decodes with an int8
cache; ``:sdpa`` keeps one-token steps on SDPA where the split-KV Triton kernel would run (CUDA with triton:
``decode_kernel="eager"``), ``:kernel`` puts them on it (``decode_kernel="auto"``; the default is
:data:`models.kernels.DEFAULT_DECODE_KERNEL`); ``:graph`` (CUDA) replays each step from a captured CUDA graph over a fixed-capacity
view of the cache (:class:`models.graph_decode.GraphDecoder`), reported next to its eager twin. On CUDA every step is timed with CUDA
events from an idle GPU. Without an MHA variant an MHA baseline with the first config's
shapes is added. Default: ``gpt2 mla:naive mla mla_kvsplice_50 mla_kvsplice_70 mla_kvsplice_90``.
"""

from __future__ import annotations

from kvsplice.io.interrupt import quiet_interrupts_while_importing

PROG = "kvsplice bench-decode"
quiet_interrupts_while_importing(__name__, PROG)  # Ctrl-C during the imports below: one line, exit 130

import argparse
import platform
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from kvsplice.report.decode_timing import (DEFAULT_CONFIGS, growth, print_profiles, print_table, run, title, variants_from_specs)
from kvsplice.core.limits import MAX_TOKENS, check_count, check_fits, check_number, check_threads, gpt_run_bytes
from kvsplice.io.cli import Parser, UsageError, add_report_options, device_dtype, run_cli
from kvsplice.io.files import output_file
from kvsplice.io.write import write_json
from kvsplice.report.memory import DTYPES, cache_bytes_formula, dtype_name, parse_dtype

MAX_REPEATS = 100_000
"""Timed / warm-up steps and rounds at most (a million steps of a 124M model is days)."""


# -------------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", nargs="+", metavar="NAME[:IMPL][:int8][:sdpa|:kernel][:graph]", default=list(DEFAULT_CONFIGS),
                   help="presets or YAML configs; MLA ones may end in :naive or :absorb; :int8 for an int8 cache, "
                        ":sdpa / :kernel for SDPA / the split-KV kernel, :graph for CUDA-graph steps")
    p.add_argument("--ctx", nargs="+", type=int, default=[512, 2048, 8192], metavar="T")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=12, help="timed steps per (variant, context), in all rounds")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per (variant, context, round)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds the repeats are split over")
    p.add_argument("--max-seconds", type=float, default=None, help="cap on the seconds spent per (variant, "
                   "context): slow variants (naive MLA at long contexts) then get fewer timed steps (>= 1 per round)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="default fp32 (bf16 is slow on CPU)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    add_report_options(p, json_help="write results as JSON (and a plot FILE.png next to it)")
    p.add_argument("--plot", metavar="PNG", help="plot path (default: next to --json)")
    p.add_argument("--profile", action="store_true", help="also run torch.profiler over 3 steps of each variant at "
                   "the largest context: top ops, and the largest copy/cat (must be far below one layer's cache)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli(PROG, lambda: _main(argv))


def _main(argv: Optional[Sequence[str]]) -> int:
    args = build_parser().parse_args(argv)
    for c in args.ctx:
        check_count("--ctx", c, 1, MAX_TOKENS - 1)
    check_count("--batch", args.batch)
    check_count("--repeats", args.repeats, 1, MAX_REPEATS)
    check_count("--warmup", args.warmup, 0, MAX_REPEATS)
    check_count("--rounds", args.rounds, 1, MAX_REPEATS)
    check_threads("--threads", args.threads)
    if args.max_seconds is not None:
        check_number("--max-seconds", args.max_seconds, 0.0, lo_open=False)
    ctxs = sorted(set(args.ctx))
    device, _ = device_dtype(args)
    variants, notes = variants_from_specs(args.config, max(ctxs))
    dtype = parse_dtype(args.dtype)
    # every model lives through the run; one cache (capacity ctx + 1) and one layer's random block at a time
    weights = sum(gpt_run_bytes(v.cfg, tokens=1, batch=args.batch, elt=dtype.itemsize, cache_bytes=0,
                                logits_tokens=1) for v in variants)
    cache = max(cache_bytes_formula(v.cfg, ctxs[-1] + 1, dtype, args.batch) * (1 + 1 / v.cfg.n_layer)
                for v in variants)
    check_fits(f"--ctx {ctxs[-1]} with --batch {args.batch}", weights + cache, "the models and the filled cache",
               device)
    if device.type != "cuda" and any(v.graph for v in variants):
        raise UsageError(f"':graph' variants replay CUDA graphs and need a CUDA device, got {device}")
    inputs = {"--config": [c.split(":")[0] for c in args.config]}  # a YAML path is read: never written
    if args.json:
        args.json = output_file(args.json, force=args.force, option="--json", inputs=inputs)
    png = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if png:
        png = output_file(png, force=args.force, option="--plot", inputs=inputs,
                          outputs={"--json": args.json} if args.json else None)
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = min(args.rounds, args.repeats)
    profiles: Optional[dict] = {} if args.profile else None
    rows = run(variants, ctxs, batch=args.batch, dtype=dtype, repeats=args.repeats, warmup=args.warmup,
               rounds=rounds, device=device, progress=not args.no_progress, seed=args.seed, profile=profiles,
               max_seconds=args.max_seconds)
    report = dict(
        tool="kvsplice.bench_decode", dtype=dtype_name(dtype), batch=args.batch, device=str(device),
        threads=torch.get_num_threads(), repeats=args.repeats, warmup=args.warmup, rounds=rounds, ctx=ctxs,
        max_seconds=args.max_seconds,
        torch=torch.__version__, python=platform.python_version(), cpu=platform.processor() or platform.machine(),
        note="cache filled with random values via cache.append (timing only); each timed step attends over ctx+1 "
             "keys and is rolled back with cache.truncate(ctx); speedup = MHA median / variant median, same run",
        notes=notes, variants=[dict(label=v.label, config=v.cfg.to_dict()) for v in variants],
        results=rows, growth=growth(rows),
    )
    report["title"] = title(report)  # plots read it from the JSON
    if profiles is not None:
        report["profile"] = profiles
    print_table(report, markdown=args.markdown)
    if profiles:
        print_profiles(profiles)
    if args.json:
        print(f"wrote {write_json(report, args.json)}", file=sys.stderr)
    if png:
        from kvsplice.report.plots import plot_decode_times

        print(f"wrote {plot_decode_times(rows, png, title=report['title'])}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

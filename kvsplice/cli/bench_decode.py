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
from typing import Optional, Sequence

import torch

from kvsplice.report.decode_timing import growth, print_profiles, print_table, run, title, variants_from_specs
from kvsplice.core.limits import check_fits, gpt_run_bytes
from kvsplice.io.cli import Parser, UsageError, device_dtype, run_cli
from kvsplice.io.files import output_file
from kvsplice.io.options import add_options, from_args
from kvsplice.io.write import write_json
from kvsplice.report.memory import cache_bytes_formula, dtype_name, parse_dtype
from kvsplice.report.options import REPORT_HELP, BenchDecodeOptions


# -------------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    """The command line of :class:`BenchDecodeOptions` (its fields declare it)."""
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(p, BenchDecodeOptions,
                help={**REPORT_HELP, "json": "write results as JSON (and a plot FILE.png next to it)"})
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli(PROG, lambda: _main(argv))


def _main(argv: Optional[Sequence[str]]) -> int:
    opts = from_args(BenchDecodeOptions, build_parser().parse_args(argv))
    ctxs = opts.contexts
    device, _ = device_dtype(opts)
    variants, notes = variants_from_specs(list(opts.config), max(ctxs))
    dtype = parse_dtype(opts.dtype)
    if device.type != "cuda" and any(v.graph for v in variants):
        raise UsageError(f"':graph' variants replay CUDA graphs and need a CUDA device, got {device}")
    inputs = {"--config": [c.split(":")[0] for c in opts.config]}  # a YAML path is read: never written
    json_path = None if not opts.json else output_file(opts.json, force=opts.force, option="--json", inputs=inputs)
    png = opts.plot or (str(json_path.with_suffix(".png")) if json_path else None)
    if png:
        png = output_file(png, force=opts.force, option="--plot", inputs=inputs,
                          outputs={"--json": json_path} if json_path else None)
    # the outputs first (a user's error whatever memory is free); every model lives through the run; one cache (capacity ctx + 1) and one layer's random block at a time
    weights = sum(gpt_run_bytes(v.cfg, tokens=1, batch=opts.batch, elt=dtype.itemsize, cache_bytes=0,
                                logits_tokens=1) for v in variants)
    cache = max(cache_bytes_formula(v.cfg, ctxs[-1] + 1, dtype, opts.batch) * (1 + 1 / v.cfg.n_layer)
                for v in variants)
    check_fits(f"--ctx {ctxs[-1]} with --batch {opts.batch}", weights + cache, "the models and the filled cache",
               device)
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    rounds = min(opts.rounds, opts.repeats)
    profiles: Optional[dict] = {} if opts.profile else None
    rows = run(variants, ctxs, batch=opts.batch, dtype=dtype, repeats=opts.repeats, warmup=opts.warmup,
               rounds=rounds, device=device, progress=opts.progress, seed=opts.seed, profile=profiles,
               max_seconds=opts.max_seconds)
    report = dict(
        tool="kvsplice.bench_decode", dtype=dtype_name(dtype), batch=opts.batch, device=str(device),
        threads=torch.get_num_threads(), repeats=opts.repeats, warmup=opts.warmup, rounds=rounds, ctx=ctxs,
        max_seconds=opts.max_seconds,
        torch=torch.__version__, python=platform.python_version(), cpu=platform.processor() or platform.machine(),
        note="cache filled with random values via cache.append (timing only); each timed step attends over ctx+1 "
             "keys and is rolled back with cache.truncate(ctx); speedup = MHA median / variant median, same run",
        notes=notes, variants=[dict(label=v.label, config=v.cfg.to_dict()) for v in variants],
        results=rows, growth=growth(rows),
    )
    report["title"] = title(report)  # plots read it from the JSON
    if profiles is not None:
        report["profile"] = profiles
    print_table(report, markdown=opts.markdown)
    if profiles:
        print_profiles(profiles)
    if json_path:
        print(f"wrote {write_json(report, json_path)}", file=sys.stderr)
    if png:
        from kvsplice.report.plots import plot_decode_times

        print(f"wrote {plot_decode_times(rows, png, title=report['title'])}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

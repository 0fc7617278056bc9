"""Measure the decode cache of each variant after a real prefill + token-by-token decode and check it against the
byte formula.

    kvsplice verify-memory                                   # the five 124M presets, fp16, 256/512/1024
    kvsplice verify-memory --dtype fp16 --seq-lens 256 512 1024 --json results/memory_fp16.json
    kvsplice verify-memory --config mla configs/my_run.yaml --seq-lens 2048   # block_size auto-raised
    kvsplice verify-memory --ckpt checkpoints/mla/last.ckpt --dtype bf16

For every variant and length ``L`` the model (random weights unless ``--ckpt``; eval mode; CUDA if available) is
cast to ``--dtype``, a cache with ``capacity=L`` is created with ``model.new_cache``, ``L - k`` tokens are
prefilled and the last ``k`` (``--decode-steps``, default 8) are decoded one at a time through the real cache.
Then the cache is measured from its own tensors (:func:`kvsplice.report.memory.measure_cache`: live views and allocated
storage; on CUDA also the caching allocator's delta) and compared with :func:`kvsplice.report.memory.cache_bytes_formula`
at the same dtype. The exit status is 1 if any measurement differs from the formula, 2 on bad arguments.
A JSON report (``--json``) gets a plot of cache MiB vs length next to it (same name, ``.png``).
"""

from __future__ import annotations

from kvsplice.io.interrupt import quiet_interrupts_while_importing

PROG = "kvsplice verify-memory"
quiet_interrupts_while_importing(__name__, PROG)  # Ctrl-C during the imports below: one line, exit 130

import argparse
import platform
import sys
from typing import Optional, Sequence

import torch

from kvsplice.report.memory_check import (DEFAULT_CONFIGS, GIB, checkpoint_variants, preset_variants, print_table,
                                          quantised_variants, run, title)
from kvsplice.core.limits import check_count, check_fits, check_number, gpt_run_bytes
from kvsplice.io.cli import Parser, add_report_options, device_dtype, run_cli
from kvsplice.io.files import output_file
from kvsplice.io.write import write_json
from kvsplice.report.memory import DTYPES, cache_bytes_formula, dtype_name, parse_dtype
from models.config import PRESETS

DEFAULT_DECODE_STEPS = 8


# -------------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", nargs="+", metavar="NAME",
                     help=f"presets ({', '.join(PRESETS)}) or LightningCLI YAML files (a path, or the stem of "
                          f"a file under configs/); default: the five 124M presets")
    src.add_argument("--ckpt", nargs="+", metavar="PATH", help="training checkpoints (python -m training.fit)")
    p.add_argument("--seq-lens", nargs="+", type=int, default=[256, 512, 1024], metavar="L")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    p.add_argument("--cache-quant", choices=["int8"], default=None, help="also measure every variant with an int8 "
                   "cache (int8 rows + one fp16 scale per row); vs MHA stays MHA's unquantised cache at --dtype")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--budget-gb", type=float, default=24.0, help="memory budget in GiB (2^30 bytes) for the "
                   "'sequences that fit' column (default 24)")
    p.add_argument("--decode-steps", type=int, default=None, help="tokens decoded one at a time after the prefill "
                   "(default 8, fewer when the shortest --seq-lens leaves no room; an explicit value must be < it)")
    add_report_options(p, json_help="write the report as JSON (and a plot FILE.png next to it)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli(PROG, lambda: _main(argv))


def _main(argv: Optional[Sequence[str]]) -> int:
    args = build_parser().parse_args(argv)
    for L in args.seq_lens:
        check_count("--seq-lens", L)
    check_count("--batch", args.batch)
    check_number("--budget-gb", args.budget_gb)
    seq_lens = sorted(set(args.seq_lens))
    notes: list[str] = []
    if args.decode_steps is None:
        args.decode_steps = min(DEFAULT_DECODE_STEPS, seq_lens[0] - 1)
        if args.decode_steps < DEFAULT_DECODE_STEPS:
            notes.append(f"--decode-steps {args.decode_steps} (default {DEFAULT_DECODE_STEPS}): the shortest "
                         f"--seq-lens {seq_lens[0]} leaves room for no more after a one-token prefill")
    else:
        check_count("--decode-steps", args.decode_steps, 0, seq_lens[0] - 1,
                    f"the shortest --seq-lens {seq_lens[0]} less the one token the prefill needs")
    device, _ = device_dtype(args)
    if args.ckpt:
        variants = checkpoint_variants(args.ckpt, max(seq_lens))
    else:
        variants = preset_variants(args.config or DEFAULT_CONFIGS, max(seq_lens), notes)
    if args.cache_quant:
        variants = variants + quantised_variants(variants, args.cache_quant)
    elt = parse_dtype(args.dtype).itemsize
    need = max(gpt_run_bytes(v.cfg, tokens=seq_lens[-1], batch=args.batch, elt=elt, logits_tokens=seq_lens[-1],
                             cache_bytes=cache_bytes_formula(v.cfg, seq_lens[-1], parse_dtype(args.dtype), args.batch))
               for v in variants)
    check_fits(f"--seq-lens {seq_lens[-1]} with --batch {args.batch}", need, "the model, prefill and cache",
               device)
    if args.json:
        inputs = {"--ckpt": args.ckpt, "--config": args.config}
        args.json = output_file(args.json, force=args.force, option="--json", inputs=inputs)
        output_file(args.json.with_suffix(".png"), force=args.force, option="--json's plot", inputs=inputs,
                    outputs={"--json": args.json})
    for n in notes:
        print(f"note: {n}", file=sys.stderr)

    dtype = parse_dtype(args.dtype)
    budget_bytes = int(args.budget_gb * GIB)
    rows = run(variants, seq_lens, dtype=dtype, batch=args.batch, budget_bytes=budget_bytes,
               decode_steps=args.decode_steps, device=device, progress=not args.no_progress, seed=args.seed)
    report = dict(
        tool="kvsplice.verify_memory", dtype=dtype_name(dtype), batch=args.batch, device=str(device),
        cache_quant=args.cache_quant, budget_gib=args.budget_gb, budget_bytes=budget_bytes, decode_steps=args.decode_steps, seq_lens=seq_lens,
        torch=torch.__version__, python=platform.python_version(), notes=notes,
        ok=all(r["ok"] for r in rows), rows=rows,
    )
    report["title"] = title(report)  # plots read it from the JSON
    print_table(report, markdown=args.markdown)
    for r in rows:
        for prob in r["problems"]:
            print(f"MISMATCH {r['variant']} L={r['seq_len']}: {prob}", file=sys.stderr)
    if args.json:
        from kvsplice.report.plots import plot_cache_vs_seqlen

        out = write_json(report, args.json)
        png = plot_cache_vs_seqlen(rows, out.with_suffix(".png"), title=report["title"])
        print(f"wrote {out} and {png}", file=sys.stderr)
    if not report["ok"]:
        print("verify_memory: measured cache bytes differ from the formula", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

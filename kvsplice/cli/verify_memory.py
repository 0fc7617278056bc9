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
from kvsplice.core.limits import check_fits, gpt_run_bytes
from kvsplice.io.cli import Parser, device_dtype, run_cli
from kvsplice.io.files import output_file
from kvsplice.io.options import add_options, from_args
from kvsplice.io.write import write_json
from kvsplice.report.memory import cache_bytes_formula, dtype_name, parse_dtype
from kvsplice.report.options import REPORT_HELP, VerifyMemoryOptions


# -------------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    """The command line of :class:`VerifyMemoryOptions` (its fields declare it)."""
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(p, VerifyMemoryOptions,
                help={**REPORT_HELP, "json": "write the report as JSON (and a plot FILE.png next to it)"})
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli(PROG, lambda: _main(argv))


def _main(argv: Optional[Sequence[str]]) -> int:
    opts = from_args(VerifyMemoryOptions, build_parser().parse_args(argv))
    seq_lens = opts.lengths
    decode_steps, note = opts.steps()
    notes: list[str] = [note] if note else []
    device, _ = device_dtype(opts)
    if opts.ckpt:
        variants = checkpoint_variants(list(opts.ckpt), max(seq_lens))
    else:
        variants = preset_variants(list(opts.config or DEFAULT_CONFIGS), max(seq_lens), notes)
    if opts.cache_quant:
        variants = variants + quantised_variants(variants, opts.cache_quant)
    dtype = parse_dtype(opts.dtype)
    need = max(gpt_run_bytes(v.cfg, tokens=seq_lens[-1], batch=opts.batch, elt=dtype.itemsize,
                             logits_tokens=seq_lens[-1],
                             cache_bytes=cache_bytes_formula(v.cfg, seq_lens[-1], dtype, opts.batch))
               for v in variants)
    check_fits(f"--seq-lens {seq_lens[-1]} with --batch {opts.batch}", need, "the model, prefill and cache",
               device)
    json_path = None
    if opts.json:
        inputs = {"--ckpt": opts.ckpt and list(opts.ckpt), "--config": opts.config and list(opts.config)}
        json_path = output_file(opts.json, force=opts.force, option="--json", inputs=inputs)
        output_file(json_path.with_suffix(".png"), force=opts.force, option="--json's plot", inputs=inputs,
                    outputs={"--json": json_path})
    for n in notes:
        print(f"note: {n}", file=sys.stderr)

    budget_bytes = int(opts.budget_gb * GIB)
    rows = run(variants, seq_lens, dtype=dtype, batch=opts.batch, budget_bytes=budget_bytes,
               decode_steps=decode_steps, device=device, progress=opts.progress, seed=opts.seed)
    report = dict(
        tool="kvsplice.verify_memory", dtype=dtype_name(dtype), batch=opts.batch, device=str(device),
        cache_quant=opts.cache_quant, budget_gib=opts.budget_gb, budget_bytes=budget_bytes, decode_steps=decode_steps,
        seq_lens=seq_lens,
        torch=torch.__version__, python=platform.python_version(), notes=notes,
        ok=all(r["ok"] for r in rows), rows=rows,
    )
    report["title"] = title(report)  # plots read it from the JSON
    print_table(report, markdown=opts.markdown)
    for r in rows:
        for prob in r["problems"]:
            print(f"MISMATCH {r['variant']} L={r['seq_len']}: {prob}", file=sys.stderr)
    if json_path is not None:
        from kvsplice.report.plots import plot_cache_vs_seqlen

        out = write_json(report, json_path)
        png = plot_cache_vs_seqlen(rows, out.with_suffix(".png"), title=report["title"])
        print(f"wrote {out} and {png}", file=sys.stderr)
    if not report["ok"]:
        print("verify_memory: measured cache bytes differ from the formula", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

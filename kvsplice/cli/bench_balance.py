"""The BalanceKV paper's single-layer experiment: attention approximation error of BalanceKV vs uniform sampling.

Usage::

    kvsplice bench-balance --model DIR|CKPT --data PATH [--layers 0 1 ...] [--T 1 2 3 4] [--seeds 10]
        [--n-queries 64] [--context N] [--windows 4] [--n-sink 4] [--n-recent 16] [--block-size 64]
        [--c-scale 1.0] [--kernel-temp 1.0] [--arms balancekv uniform coinflip] [--tokenizer PATH]
        [--json FILE] [--markdown]

``--model`` is anything :func:`kvsplice.loading.load_model` loads: an HF model directory (config.json + tokenizer;
e.g. stories260K converted by ``kvsplice convert-llama2c``) or a ``training.fit`` ``.ckpt``.

What is measured, per layer ``l`` and per ``T``:

* The model runs over ``--windows`` windows of ``--context`` tokens of real text (``kvsplice.loading``: the
  stories of ``--data`` tokenised with the model's tokenizer, BOS/EOS-separated). Per layer the keys (post-RoPE for
  Llama) / values / queries are taken (:func:`kvsplice.adapters.capture.extract_qkv`).
* The **context** to compress is the first ``C = context - n_queries`` tokens; the **queries** are the last
  ``n_queries`` positions. Exact attention ``Attn(q) = softmax(q·K_Cᵀ·s)·V_C`` of every query head over the context
  (the context precedes every query: no mask), and its estimate ``z(q) = softmax(q·K_Sᵀ·s + logw_S)·V_S`` over the
  kept subset ``S`` with its log-weights (the same :func:`~kvsplice.core.attention.weighted_attend` the cache uses).
* **What is kept** at ``T``: the first ``n_sink`` tokens and the last ``n_recent + ((C - n_sink - n_recent) mod
  2^Tmax)`` context tokens intact (weight 1; ``Tmax`` = the largest ``T`` of the run, so the intact tokens are the
  same at every ``T``); the middle ``m = C - n_sink - n_recent`` rounded down to a multiple of ``2^Tmax`` is
  compressed ``2^T``× to ``m / 2^T`` tokens, each with weight ``2^T`` (BalanceKV: ``T`` block-parallel
  halvings, :class:`~kvsplice.select.selectors.BalanceKVSelector` with ``n_halvings=T``; uniform:
  :class:`~kvsplice.select.selectors.UniformSelector`, ``m / 2^T`` middle tokens sampled without replacement, weight
  ``2^T``). Both keep exactly the same budget and the same intact tokens; ``T = 0`` keeps everything (error 0).
  One independent selection per (window, KV head); GQA query heads share their KV head's selection.
* ``coinflip`` (ablation) is BalanceKV's block-parallel halving with ``c_scale = inf``: every step a fair
  coin (exact halves per block) — stratified random halving without the discrepancy walk. If BalanceKV is no
  better than ``coinflip``, the walk's balancing does not help.
* Error per seed: ``‖Z − A‖_F / ‖A‖_F`` over all windows × query heads × queries × value dims (``rel``),
  and the mean over (window, head, query) of ``‖z − a‖ / ‖a‖`` (``rel_q``). Reported: mean ± std over seeds.

The walk's threshold is the practical rule of :func:`kvsplice.select.balance.block_balance`: ``c = c_scale ·
median_i κ(x_i, x_i)`` per block (clamped greedy steps beyond it), kernel ``exp(⟨k,k'⟩·s)·(⟨v,v'⟩ + mean‖v‖²)`` on
block-centred keys — not the paper's worst-case ``c = 30·log(n/δ)·max κ``, under which the signs are
indistinguishable from coin flips at these sizes (that regime is what ``coinflip`` measures).

Output: a table per layer × T × method (rich, or ``--markdown``), and with ``--json FILE`` the JSON report plus a PNG
(same path, ``.png``): relative error vs T per layer, one line per method.
"""

from __future__ import annotations

from kvsplice.io.interrupt import quiet_interrupts_while_importing

PROG = "kvsplice bench-balance"
MAX_SEEDS = 1000
"""The most ``--seeds`` (selections per window and KV head): the run's time grows with it."""
quiet_interrupts_while_importing(__name__, PROG)  # Ctrl-C during the imports below: one line, exit 130

import argparse
import sys
from typing import Optional

import torch

from kvsplice.core.limits import MAX_TOKENS, check_count, check_number, check_threads
from kvsplice.io.cli import Parser, pos_int, run_cli
from kvsplice.loading import LoadError, iter_texts, load_model
from kvsplice.io.files import output_file
from kvsplice.io.write import write_json
from kvsplice.select.experiment import (ARMS, BenchError, keep_plan, layer_errors, make_arm, plot,
                                        print_table, run_bench)

__all__ = ["ARMS", "keep_plan", "layer_errors", "main", "make_arm"]


# ------------------------------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG,
                                description="Single-layer attention approximation: BalanceKV vs uniform sampling.")
    p.add_argument("--model", required=True, help="HF model directory (config.json + tokenizer) or a .ckpt")
    p.add_argument("--tokenizer", default=None, help="tokenizer override (see kvsplice.loading)")
    p.add_argument("--data", required=True, help="text: .txt/.json/.jsonl file or folder of stories")
    p.add_argument("--layers", type=int, nargs="+", default=None, help="layers (default: all)")
    p.add_argument("--T", type=int, nargs="+", default=[1, 2, 3, 4], help="halvings (compression 2^T of the middle)")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--n-queries", type=int, default=64)
    p.add_argument("--context", type=int, default=None, help="tokens per window (default: min(1024, positions))")
    p.add_argument("--windows", type=int, default=4, help="text windows (one selection per window and KV head)")
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--n-recent", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--c-scale", type=float, default=1.0, help="walk threshold c = c_scale * median kappa")
    p.add_argument("--kernel-temp", type=float, default=1.0,
                   help="walk kernel exp(kernel_temp * <k,k'> / sqrt(d)) (1 = the paper's)")
    p.add_argument("--arms", "--methods", dest="methods", nargs="+", default=list(ARMS), choices=ARMS,
                   help="the selectors compared (--methods is the old name)")
    p.add_argument("--json", default=None, help="write the report here (and the plot next to it, .png)")
    p.add_argument("--force", action="store_true", help="overwrite an existing --json file")
    p.add_argument("--markdown", action="store_true", help="print a markdown table instead of a rich table")
    p.add_argument("--threads", type=pos_int, default=1, help="torch threads (default 1)")
    return p


def _check_counts(args) -> None:
    """Every count and number within its range before the text or the model is read (the model's own limits,
    its layers and positions, are checked once it is loaded)."""
    check_count("--seeds", args.seeds, 1, MAX_SEEDS, "the run's time grows with it")
    check_count("--windows", args.windows, 1, MAX_TOKENS)
    check_count("--n-queries", args.n_queries, 1, MAX_TOKENS)
    if args.context is not None:
        check_count("--context", args.context, 2, MAX_TOKENS)
    check_count("--n-sink", args.n_sink, 0, MAX_TOKENS)
    check_count("--n-recent", args.n_recent, 0, MAX_TOKENS)
    for t in args.T:
        check_count("--T", t, 0, 30, "a compression of 2^30")
    for layer in args.layers or []:
        check_count("--layers", layer, 0, MAX_TOKENS)
    check_number("--c-scale", args.c_scale)
    check_number("--kernel-temp", args.kernel_temp, lo_open=False)


def main(argv: Optional[list[str]] = None) -> int:
    return run_cli(PROG, lambda: _main(argv), (BenchError, LoadError))


def _main(argv: Optional[list[str]]) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(check_threads("--threads", args.threads))
    if args.json:
        inputs = {"--model": args.model, "--tokenizer": args.tokenizer, "--data": args.data}
        args.json = output_file(args.json, force=args.force, option="--json", inputs=inputs)
        output_file(args.json.with_suffix(".png"), force=args.force, option="--json's plot", inputs=inputs,
                    outputs={"--json": args.json})
    _check_counts(args)
    if args.block_size < 2 or args.block_size % 2:
        raise BenchError(f"--block-size must be an even number >= 2, got {args.block_size}")
    iter_texts(args.data)  # a missing / unreadable --data fails here, before the model loads
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # keep stderr to our own lines
    except Exception:  # noqa: BLE001
        pass
    loaded = load_model(args.model, tokenizer=args.tokenizer)
    with torch.no_grad():
        report = run_bench(loaded.model, loaded.tokenizer, args.data, layers=args.layers, Ts=args.T,
                           seeds=args.seeds, n_queries=args.n_queries, context=args.context,
                           windows=args.windows, n_sink=args.n_sink, n_recent=args.n_recent,
                           block_size=args.block_size, c_scale=args.c_scale,
                           kernel_temp=args.kernel_temp, methods=args.methods,
                           max_positions=loaded.max_positions)
    report["config"]["model"] = args.model
    report["command"] = "kvsplice bench-balance " + " ".join(argv if argv is not None else sys.argv[1:])
    print_table(report, markdown=args.markdown)
    if args.json:
        out = write_json(report, args.json)
        png = plot(report, out.with_suffix(".png"))
        print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
quiet_interrupts_while_importing(__name__, PROG)  # Ctrl-C during the imports below: one line, exit 130

import argparse
import sys
from typing import Optional

import torch

from kvsplice.io.cli import Parser, run_cli
from kvsplice.io.options import add_options, from_args
from kvsplice.loading import LoadError, iter_texts, load_model
from kvsplice.io.files import output_file
from kvsplice.io.write import write_json
from kvsplice.select.experiment import (ARMS, BenchError, keep_plan, layer_errors, make_arm, plot,
                                        print_table, run_bench)
from kvsplice.select.experiment_options import BenchBalanceOptions

__all__ = ["ARMS", "build_parser", "keep_plan", "layer_errors", "main", "make_arm"]


# ------------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    """The command line of :class:`BenchBalanceOptions` (its fields declare it)."""
    p = Parser(prog=PROG, description="Single-layer attention approximation: BalanceKV vs uniform sampling.")
    add_options(p, BenchBalanceOptions, help={"force": "overwrite an existing --json file"})
    return p


def main(argv: Optional[list[str]] = None) -> int:
    return run_cli(PROG, lambda: _main(argv), (BenchError, LoadError))


def _main(argv: Optional[list[str]]) -> int:
    opts = from_args(BenchBalanceOptions, build_parser().parse_args(argv))  # every count checked (one line)
    torch.set_num_threads(opts.threads)
    json_path = None
    if opts.json:
        inputs = {"--model": opts.model, "--tokenizer": opts.tokenizer, "--data": opts.data}
        json_path = output_file(opts.json, force=opts.force, option="--json", inputs=inputs)
        output_file(json_path.with_suffix(".png"), force=opts.force, option="--json's plot", inputs=inputs,
                    outputs={"--json": json_path})
    iter_texts(opts.data)  # a missing / unreadable --data fails here, before the model loads
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # keep stderr to our own lines
    except Exception:  # noqa: BLE001
        pass
    loaded = load_model(opts.model, tokenizer=opts.tokenizer)
    with torch.no_grad():
        report = run_bench(loaded.model, loaded.tokenizer, opts, max_positions=loaded.max_positions)
    report["config"]["model"] = opts.model
    report["command"] = "kvsplice bench-balance " + " ".join(argv if argv is not None else sys.argv[1:])
    print_table(report, markdown=opts.markdown)
    if json_path is not None:
        out = write_json(report, json_path)
        png = plot(report, out.with_suffix(".png"))
        print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Evaluate post-training KV bases on held-out text: perplexity with the full vs the compressed cache, per-layer
attention-score / output errors, Lesens' gap, and the cache's measured bytes.

    kvsplice eval-bases --model DIR|HUB_ID|CKPT --bases FILE.safetensors [FILE2 ...] --data PATH \\
        [--tokens N] [--seq-len T] [--batch-size B] [--chunk-size C] [--json REPORT.json]

What is measured (``--data`` must be held-out text, not the calibration text; a warning is printed otherwise):

* **Perplexity.** The text is tokenised story by story (BOS/EOS between stories, as the tokenizer does), cut to
  ``--tokens`` and into ``--seq-len`` windows (default: the model's context, <= 1024). Each window is fed through a
  fresh cache of a ``Decoder(model, LowRank(bases))`` in chunks of ``--chunk-size`` tokens (default 64;
  ``1`` = token by token): every chunk is appended to the cache first and its queries attend over the *cached*
  representation, so with bases every token (the first chunk included) attends over compressed keys and values.
  The chunk size changes only speed, not the numbers (up to float rounding). The full-cache reference is the same
  driver with ``bases=None`` (a plain K/V cache); the model's own forward perplexity is printed as a sanity check.
  Perplexity = ``exp(Σ NLL / #predicted)`` over all windows (``T − 1`` predictions per window).
* **Per-layer errors on the held-out text**, from Grams of its keys/queries/values (:func:`kvsplice.lowrank.calibrate
  .calibrate` in the bases' RoPE mode; :func:`kvsplice.lowrank.fit_errors.bases_errors`), aggregated over a layer's KV
  heads as ``sqrt(Σ_j num_j / Σ_j den_j)``: attention-score error ``‖KQᵀ − K A Bᵀ Qᵀ‖/‖KQᵀ‖`` (queries of each group
  concatenated; also the group-summed form), key reconstruction error, value error through ``W_O``
  ``‖V W_Oᵀ − V̂ W_Oᵀ‖/‖V W_Oᵀ‖``.
* **Attention-output error**, measured directly on the first ``--err-windows`` windows: per layer, the exact
  ``q, k, v`` of the model (:func:`kvsplice.adapters.capture.extract_qkv`, teacher-forced: no error propagation between
  layers) vs ``k̂ = k k_enc k_decᵀ`` (pre-RoPE: rebuilt before RoPE, then rotated) and ``v̂ = v v_enc v_decᵀ``;
  causal attention, then ``W_O``: ``‖Y − Ŷ‖_F/‖Y‖_F``.
* **Lesens' gap** at each head's key rank on the held-out Grams: ``ε = err_K-only − err_KQᵀ ≥ 0`` relative to
  ``‖KQᵀ‖²``, with the two errors (oracle fits on this text: what K-only SVD gives up vs the attention-aware optimum).
* **Cache bytes** of the first batch's cache after decoding: measured from its tensors
  (:func:`kvsplice.report.memory.measure_cache`), vs the formula ``Σ_layers Σ_heads (R_k + R_v) · T · B · bytes``, vs the
  full K/V cache of the same batch at the same dtype (measured, and ``2·L·H_kv·d·T·B·bytes``).

Bases fitted for another model, or a bases file with NaN/inf, integer or misshapen tensors, fail with one line
(:class:`kvsplice.lowrank.bases.BasesMismatchError`) before the model loads; every error exits with status 2.

Methods: ``--method SPEC`` evaluates any registered method or stack by its spec (:mod:`kvsplice.core.build`:
``kivi4``, ``select:snapkv@0.25+int8``, ``lowrank:r4.safetensors+int8``, a ``.json`` spec file) by the protocol of
:func:`kvsplice.evaluation.protocol.evaluate` — ``--prompt-len`` tokens compressed, the rest scored — next to the
full cache, measured bytes == formula (``--plan`` is the same for a plan's spec). Two names select a dedicated evaluator
from :data:`EVALUATORS` instead: ``static`` (saved ``--bases`` files with the per-layer diagnostics, the default) and
``fd-online`` (:mod:`kvsplice.evaluation.online`, its options from :data:`METHOD_OPTIONS`).
:meth:`EvalContext.decode` works with any :class:`kvsplice.decode.Decoder`. The logic lives in
:mod:`kvsplice.evaluation`.
"""

from __future__ import annotations

from kvsplice.io.interrupt import quiet_interrupts_while_importing

PROG = "kvsplice eval-bases"
quiet_interrupts_while_importing(__name__, PROG)  # Ctrl-C during the imports below: one line, exit 130

import argparse
import dataclasses
import sys
from typing import Any, Callable, Optional, Sequence

import torch

from kvsplice.core.limits import check_fits
from kvsplice.io.cli import Parser, default_seq_len, device_dtype, run_cli
from kvsplice.io.files import output_file
from kvsplice.io.inputs import SpecArgs
from kvsplice.io.options import add_options, from_args
from kvsplice.io.write import write_json
from kvsplice.lowrank.bases import BasesMismatchError, KVBases
from kvsplice.evaluation.context import EvalContext, EvalError, load_windows
from kvsplice.evaluation.lowrank import eval_static
from kvsplice.evaluation.online import eval_fd_online, print_diagnostics
from kvsplice.evaluation.options import EVAL_TOKENS, EvalBasesOptions, FdOnlineOptions

__all__ = ["EVALUATORS", "METHOD_OPTIONS", "build_parser", "main", "make_context", "print_results"]


Evaluator = Callable[[EvalContext, EvalBasesOptions], list]
EVALUATORS: dict[str, Evaluator] = {"static": eval_static, "fd-online": eval_fd_online}
"""Method name → evaluator. ``static``: saved bases files (``--bases``); ``fd-online``: online FD bases."""
METHOD_OPTIONS: dict[str, type] = {"fd-online": FdOnlineOptions}
"""Method name → the options of that method (a base of :class:`EvalBasesOptions`; their own group in ``--help``,
titled by their ``GROUP``)."""

HELP = {"model": "model directory, training .ckpt or Hugging Face Hub id (the model the bases were fitted for)",
        "tokenizer": "override the model's tokenizer", "batch_size": "windows decoded together (default 8)",
        "json": "write the full report (per-layer and per-head numbers) as JSON",
        "force": "overwrite an existing --json file"}
"""This command's help of the options it shares with ``fit-bases``
(:class:`~kvsplice.lowrank.options.BasesTextOptions`)."""


def build_parser() -> argparse.ArgumentParser:
    """The command line of :class:`EvalBasesOptions` (its fields declare it), each method's options in a group."""
    p = Parser(prog=PROG, description="Evaluate post-training KV bases on held-out text: "
                                "perplexity full vs compressed cache, per-layer errors, Lesens' gap, cache bytes.")
    groups = {}
    for cls in METHOD_OPTIONS.values():
        g = p.add_argument_group(cls.GROUP)
        groups.update({f.name: g for f in dataclasses.fields(cls)})
    add_options(p, EvalBasesOptions, help=HELP, groups=groups)
    return p


def make_context(opts: EvalBasesOptions, loaded=None) -> EvalContext:
    """The model (``loaded``, else loaded as ``opts`` says) and ``opts.eval_tokens`` of the ``opts.data`` text in
    windows of ``opts.seq_len`` (default: the model's context, at most 1024)."""
    from kvsplice.loading import load_model

    if loaded is None:
        device, dtype = device_dtype(opts)
        loaded = load_model(opts.model, tokenizer=opts.tokenizer, dtype=dtype, device=device)
    seq_len = opts.seq_len or default_seq_len(loaded.max_positions)
    if loaded.max_positions is not None and seq_len > loaded.max_positions:
        raise EvalError(f"--seq-len {seq_len} exceeds the model's {loaded.max_positions} positions")
    check_fits(f"--batch-size {opts.batch_size} with --seq-len {seq_len}", 4 * opts.batch_size * seq_len *
               loaded.tokenizer.vocab_size, "a forward's logits", next(loaded.model.parameters()).device)
    windows, info = load_windows(loaded, opts.data, opts.eval_tokens, seq_len, opts.progress)
    return EvalContext(loaded, windows, batch_size=opts.batch_size, chunk_size=opts.chunk_size,
                       err_windows=opts.err_windows, progress=opts.progress, data_info=info)


def _fmt_ranks(ranks: list[list[int]]) -> str:
    flat = [r for layer in ranks for r in layer]
    return str(flat[0]) if len(set(flat)) == 1 else f"{min(flat)}–{max(flat)} (μ {sum(flat) / len(flat):.2f})"


def print_results(ctx: EvalContext, results: list[dict[str, Any]], console=None, per_layer: bool = True) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=max(Console().width, 132))
    full = ctx.full()
    d = ctx.data_info
    console.print(f"held-out text: {d.get('tokens', ctx.windows.numel()):,} tokens ({ctx.windows.shape[0]} windows × "
                  f"{ctx.windows.shape[1]}) from {d.get('source')}; decoded in chunks of {ctx.chunk_size} through "
                  f"the cache" + (f" — {d['note']}" if "note" in d else ""), soft_wrap=True)
    t = Table(title="perplexity and cache bytes (full K/V cache vs compressed coefficient cache)")
    for col in ("cache", "method", "rope", "R_k", "R_v", "numbers/token", "ppl", "ppl / full", "measured bytes",
                "= formula", "×smaller than full K/V"):
        t.add_column(col, justify="left" if col in ("cache", "method") else "right",
                     no_wrap=col in ("cache", "method"))
    fc = full["cache"]
    t.add_row("full K/V", "—", "—", "—", "—", str(full["elements_per_token"]), f"{full['ppl']:.4f}", "1",
              f"{fc['measured_live_bytes']:,}", "✓" if fc["bytes_match"] else f"≠ {fc['formula_bytes']:,}", "1")
    for r in results:
        c = r["cache"]
        t.add_row(r["label"], r["method"], r["rope"], _fmt_ranks(r["ranks_k"]), _fmt_ranks(r["ranks_v"]),
                  str(r["elements_per_token"]), f"{r['ppl']:.4f}", f"{r['ppl_ratio']:.4f}",
                  f"{c['measured_live_bytes']:,}", "✓" if c["bytes_match"] else f"≠ {c['formula_bytes']:,}",
                  f"{c['compression']:.2f}")
    console.print(t)
    console.print(f"model's own forward perplexity on the same windows: {full['model_forward_ppl']:.4f} "
                  f"(full-cache decode: {full['ppl']:.4f}); bytes: the first batch's cache ({fc['batch_size']} × "
                  f"{fc['seq_len']} tokens, {fc['dtype']}) measured from its tensors after decoding; formula "
                  f"Σ_layers Σ_heads (R_k + R_v)·T·B·bytes (full: 2·L·H_kv·d·T·B·bytes)", soft_wrap=True)
    if not per_layer:
        return
    for r in (x for x in results if "layers" in x):  # fd-online rows have no Gram-based errors
        lt = Table(title=f"{r['label']}: per-layer errors on the held-out text (relative; Lesens at each head's "
                         f"key rank, oracle fits on this text)")
        for col in ("layer", "score err", "score err (Σq)", "key err", "value err (W_O)", "attn-out err",
                    "K-only opt", "attn-aware opt", "Lesens ε/‖KQᵀ‖²"):
            lt.add_column(col, justify="right")
        for l, row in enumerate(r["layers"]):
            lt.add_row(str(l), f"{row['scores']:.4f}", f"{row['scores_sum']:.4f}", f"{row['keys']:.4f}",
                       f"{row['values']:.4f}", f"{row['attn_out']:.4f}", f"{row['lesens']['konly_opt_err']:.4f}",
                       f"{row['lesens']['kq_opt_err']:.4f}", f"{row['lesens']['gap_rel']:.2e}")
        console.print(lt)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from kvsplice.loading import LoadError

    from kvsplice.planning.spec import PlanError

    return run_cli(PROG, lambda: _main(argv), (EvalError, LoadError, BasesMismatchError, PlanError, TypeError))


def _main(argv: Optional[Sequence[str]]) -> int:
    opts = from_args(EvalBasesOptions, build_parser().parse_args(argv))  # every count checked (one line)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    from kvsplice.loading import text_tokens

    opts = dataclasses.replace(opts, tokens=text_tokens("--tokens", opts.tokens, EVAL_TOKENS, opts.data,
                                                        text_option="data"))  # before loading
    if opts.json:
        opts = dataclasses.replace(opts, json=str(output_file(
            opts.json, force=opts.force, option="--json", inputs={
                "--model": opts.model, "--tokenizer": opts.tokenizer, "--bases": opts.bases and list(opts.bases),
                "--data": opts.data, "--plan": opts.plan, "--method": SpecArgs.of(opts.method)})))
    from kvsplice.loading.mla_folder import is_mla_folder

    if is_mla_folder(opts.model):  # a converted MLA model: its own cache, no bases (kvsplice.evaluation.native)
        return _main_native(opts)
    if opts.plan:
        return _main_plan(opts)
    if opts.method not in EVALUATORS:
        return _main_spec(opts)
    if opts.method == "static":
        if not opts.bases:
            raise EvalError("--bases FILE is required (saved bases from kvsplice fit-bases)")
        for b in opts.bases:  # fail fast, before loading the model: missing, unreadable, NaN/int/misshapen
            KVBases.load(b)
    ctx = make_context(opts)
    results = EVALUATORS[opts.method](ctx, opts)
    print_results(ctx, results, per_layer=opts.diagnostics)
    if opts.diagnostics:
        print_diagnostics(results)  # observed errors vs their bounds
    full = ctx.full()
    for r in results:
        if r.get("decode_over_forward") is not None:
            print(f"{r['label']}: decode {r['decode_s']:.1f} s = {r['decode_over_forward']:.2f}× the model's plain "
                  f"forward over the same tokens ({full['forward_s']:.1f} s)")
    if opts.json:
        report = {"model": ctx.loaded.describe(), "model_fingerprint": ctx.fingerprint,
                  "data": ctx.data_info, "chunk_size": ctx.chunk_size, "batch_size": ctx.batch_size,
                  "full": ctx.full(), "results": results}
        write_json(report, opts.json)
        print(f"wrote {opts.json}")
    return 0


def eval_spec(ctx: EvalContext, opts: EvalBasesOptions, spec: dict, base_dir=None,
              label: Optional[str] = None) -> list[dict[str, Any]]:
    """A method spec on the windows by the protocol of :func:`kvsplice.evaluation.protocol.evaluate` —
    ``--prompt-len`` tokens compressed, the rest scored (default 3/4 of the window for a token selection, else 0:
    every token over the compressed cache) — next to the full cache by the same protocol."""
    from kvsplice.core.build import build_method, needs_prompt
    from kvsplice.core.short_form import format_spec
    from kvsplice.evaluation.protocol import evaluate, evaluate_each

    t = ctx.windows.shape[1]
    selects = "keep" in spec or "budget" in spec  # a token selection (kvzip too)
    p = opts.prompt_len if opts.prompt_len is not None else ((3 * t) // 4 if selects else 0)
    if p and not 1 <= p < t:
        raise EvalError(f"--prompt-len must be 0 or in [1, {t - 1}] (below --seq-len), got {p}")
    kw = dict(prompt_len=p, batch_size=ctx.batch_size, decode_chunk=ctx.chunk_size)
    full = evaluate(ctx.model, None, ctx.windows, **kw)
    method = build_method(spec, prompt_len=p or t, base_dir=base_dir)
    if needs_prompt(method):  # KVzip re-reads each window's prompt: built per window
        if not p:
            raise EvalError(f"{format_spec(spec)} compresses a prompt: give --prompt-len >= 1")
        tok = ctx.loaded.tokenizer
        res = evaluate_each(ctx.model, lambda ids: build_method(spec, prompt_ids=ids, tokenizer=tok,
                                                                base_dir=base_dir), ctx.windows, **kw)
    else:
        res = evaluate(ctx.model, method, ctx.windows, **kw)
    res.update({"label": label or format_spec(method.spec()), "spec": method.spec(),
                "full_ppl_same_protocol": full["ppl"], "ppl_ratio": res["ppl"] / full["ppl"]})
    return [res]


def eval_plan(ctx: EvalContext, opts: EvalBasesOptions) -> list[dict[str, Any]]:
    """``--plan``: the plan's spec (:mod:`kvsplice.planning`) by :func:`eval_spec`'s protocol."""
    from kvsplice.adapters import model_fingerprint
    from kvsplice.planning.spec import Plan

    plan = Plan.load(opts.plan)
    plan.check_model(model_fingerprint(ctx.model))
    (res,) = eval_spec(ctx, opts, plan.spec, plan.base_dir, f"plan: {plan.label}")
    res["plan"] = str(opts.plan)
    return [res]


def _main_plan(opts: EvalBasesOptions) -> int:
    from kvsplice.planning.spec import Plan

    if opts.bases:
        raise EvalError("give --plan or --bases, not both")
    Plan.load(opts.plan)  # fail fast, before the model loads
    return _report(opts, lambda ctx: eval_plan(ctx, opts))


def _main_spec(opts: EvalBasesOptions) -> int:
    from kvsplice.core.build import check_spec
    from kvsplice.core.short_form import load_spec

    if opts.bases:
        raise EvalError("give --method SPEC or --bases, not both (a spec names its bases: lowrank:FILE)")
    from kvsplice.planning.spec import check_plan_model

    spec, base_dir = load_spec(opts.method)
    check_spec(spec, base_dir=base_dir)  # fail fast, before the model loads

    def run(ctx: EvalContext) -> list[dict[str, Any]]:
        check_plan_model(opts.method, ctx.model)  # a plan given as a .json spec is checked as --plan is
        return eval_spec(ctx, opts, spec, base_dir)

    return _report(opts, run)


def _report(opts: EvalBasesOptions, run: Callable[[EvalContext], list]) -> int:
    ctx = make_context(opts)
    (r,) = run(ctx)
    proto = f"prompt {r['prompt_len']} compressed, {r['window'] - r['prompt_len']} scored" if r["prompt_len"] \
        else "every token over the compressed cache"
    print(f"{r['label']} on {r['windows']} windows of {r['window']} ({proto}): ppl {r['ppl']:.4f} vs full cache "
          f"{r['full_ppl_same_protocol']:.4f} ({100 * (r['ppl_ratio'] - 1):+.2f} %); " + (
              f"{r['bytes_per_token']:.1f} bytes per token at fp16 ({r['ratio_vs_fp16_full']:.2f}x smaller than "
              f"the full cache); measured bytes == formula in every batch" if r["bytes_per_token"] is not None
              else "no closed-form bytes"))
    if opts.json:
        write_json({"model": ctx.loaded.describe(), "data": ctx.data_info, "results": [r]}, opts.json)
        print(f"wrote {opts.json}")
    return 0


def _main_native(opts: EvalBasesOptions) -> int:
    from kvsplice.evaluation.native import eval_native
    from kvsplice.loading import load_model

    device, dtype = device_dtype(opts)
    loaded = load_model(opts.model, tokenizer=opts.tokenizer, dtype=dtype, device=device)
    r = eval_native(opts, loaded)
    print(f"{opts.model} (own cache) on {r['windows']} windows of {r['window']}: ppl {r['ppl']:.4f}; "
          f"{r['bytes_per_token']:.1f} bytes per token at fp16 ({r['ratio_vs_fp16_full']:.2f}x smaller than the "
          f"source's full K/V cache); measured bytes == formula in every batch")
    if opts.json:
        write_json({"model": loaded.describe(), "results": [r]}, opts.json)
        print(f"wrote {opts.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

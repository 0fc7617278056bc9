"""The budget planner: find the compression stack (tokens × rank × bits) that fits a cache budget and loses the least
on calibration text, and write it as a plan the other tools take directly.

    kvsplice plan --model DIR|GGUF|CKPT --calib TEXT (--budget-bytes-per-token N | --ratio R) \\
        [--calib-tokens 16384] [--calib-stats STATS.safetensors] [--tune-tokens 2048] [--prompt-len P] \\
        [--seq-len T] [--selectors snapkv kvzip 'kvzip(mix=observed_attention,share=0.5)'] [--stores default SPEC ...] \\
        [--device DEV] \\
        [--objective ppl|tasks|mixed] [--tune-tasks passkey niah_number_facts niah_number_stories] [--tune-n 4] \\
        [--stories TEXT] \\
        [--dtype fp32|bf16|fp16] \\
        --out plan.json [--force] [--json REPORT.json]

    kvsplice generate --model M --plan plan.json --prompt "..." --max-new-tokens 64
    kvsplice eval-bases --model M --plan plan.json --data VAL.txt
    KVSpliceHFCache(model, Plan.load("plan.json", model).method(prompt_ids=ids, tokenizer=tok))

Steps: load the model; calibrate once (every RoPE mode, loss gradients; reused from ``--calib-stats``); take the
tuning windows from the calibration text *after* the calibration tokens (``--tune-tokens``, windows of
``--seq-len``: the first ``--prompt-len`` tokens of each are the compressed prompt, the rest are scored); search
(:mod:`kvsplice.planning.search`: over the ``--stores`` specs, default the built-in list, each alone or under a
token selection); write ``--out`` (JSON: the method spec, the budget, every candidate's measurement) and,
when the stack has low rank, its bases beside it (``<out>.bases.safetensors``). The budget is bytes per prompt
token at fp16 (``--ratio R``: the fp16 full K/V cache's ``2·L·Hkv·d·2`` bytes divided by R > 1; a budget at or
above the full cache is refused: nothing to compress). A ``--calib`` text with fewer tokens than ``--calib-tokens``
+ ``--tune-tokens`` is refused (never calibrated on what there is); ``--stories`` must be text (the check every
command's text reader makes). Errors: one line, exit status 2; ``--out`` is never overwritten without ``--force``.
"""

from __future__ import annotations

from kvsplice.io.interrupt import quiet_interrupts_while_importing

PROG = "kvsplice plan"
quiet_interrupts_while_importing(__name__, PROG)  # Ctrl-C during the imports below: one line, exit 130

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from kvsplice.core.limits import check_fits
from kvsplice.io.cli import Parser, UsageError, device_dtype, help_text, pos_int, run_cli
from kvsplice.io.files import cache_file, output_file
from kvsplice.io.inputs import SpecArgs
from kvsplice.io.run_options import add_run_options, run_option_values
from kvsplice.planning.candidates import DEFAULT_STORES
from kvsplice.planning.options import MAX_TUNE_N, PLAN_CALIB_TOKENS, TUNE_TASKS, PlanOptions


def _pos_float(s: str) -> float:
    """argparse type: a finite number > 0 (``inf`` / ``nan`` are refused here, before any work)."""
    v = float(s)
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be > 0 and finite, got {s}")
    return v


def _ratio(s: str) -> float:
    """argparse type: how many times smaller than the fp16 full cache, a finite number > 1 (a ratio <= 1 is a budget
    at or above the full cache: nothing to compress)."""
    v = float(s)
    if not (v > 1 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be > 1 and finite (times smaller than the fp16 full cache; <= 1 is a "
                                         f"budget at or above the full cache), got {s}")
    return v


def _nonneg_float(s: str) -> float:
    """argparse type: a finite number >= 0."""
    v = float(s)
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be >= 0 and finite, got {s}")
    return v


def _selector(s: str) -> str:
    """argparse type: a selector the planner can build (``snapkv``, ``kvzip(mix=observed_attention,share=0.5)``)."""
    from kvsplice.planning.search import check_selector

    try:
        return check_selector(s)
    except (ValueError, TypeError) as e:  # incl. an argument that does nothing (reach= without recon=local)
        raise argparse.ArgumentTypeError(str(e).splitlines()[0]) from None


def build_parser() -> argparse.ArgumentParser:
    from kvsplice.core.registry import select_names
    from kvsplice.planning.search import DEFAULT_SELECTORS

    p = Parser(prog=PROG, description="Search the compression stack (token selection × low "
               "rank × bits) that fits a KV-cache budget with the least loss on calibration text; write a plan.")
    p.add_argument("--model", required=True, help="model directory, .gguf file, training .ckpt or Hub id")
    p.add_argument("--tokenizer", help="override the model's tokenizer")
    p.add_argument("--calib", required=True, help="calibration text (.txt/.json/.jsonl, folder, or dataset id)")
    b = p.add_mutually_exclusive_group(required=True)
    b.add_argument("--budget-bytes-per-token", type=_pos_float, help="cache bytes per prompt token (fp16 storage)")
    b.add_argument("--ratio", type=_ratio, help="times smaller than the fp16 full K/V cache (> 1)")
    p.add_argument("--calib-tokens", type=pos_int, default=PLAN_CALIB_TOKENS,
                   help=f"calibration tokens (default {PLAN_CALIB_TOKENS}); the tuning windows follow them")
    p.add_argument("--calib-stats", help="calibration statistics of the low-rank stores: reused when the file "
                   "exists, written otherwise — when --stores has a low-rank store (the default list has); with none "
                   "nothing is calibrated and the file is neither read nor written (a note says so)")
    p.add_argument("--tune-tokens", type=pos_int, default=2048, help="tuning tokens after the calibration tokens "
                   "(default 2048)")
    p.add_argument("--seq-len", type=pos_int, default=1024, help="calibration and tuning window (default 1024)")
    p.add_argument("--prompt-len", type=pos_int, help="compressed prompt per tuning window (default 3/4 of it)")
    p.add_argument("--selectors", nargs="+", default=list(DEFAULT_SELECTORS), type=_selector, metavar="SELECTOR",
                   help=help_text(f"token selectors to try, NAME[(KEY=VALUE,...)] (default "
                                  f"{' '.join(DEFAULT_SELECTORS)}; known: {', '.join(select_names())}; kvzip "
                                  f"re-reads the prompt)"))
    p.add_argument("--stores", nargs="+", metavar="SPEC", help="candidate storage methods as method specs (e.g. "
                   "int8 kivi4 mine(x=1); 'default' = the built-in list: full K/V fp16/int8, int8 keys + int4 "
                   "values (k8v4h), KIVI 4/2-bit, fisher low rank at 1.5/2/3x, int8 coefficients); default: default")
    p.add_argument("--batch-size", type=pos_int, default=2, help="windows per forward (default 2)")
    p.add_argument("--objective", choices=("ppl", "tasks", "mixed"), default="mixed", help="what the stack must "
                   "keep: mixed (default): the best tuning perplexity among the candidates with the best accuracy "
                   "on tuning task instances (seeds >= 1,000,000, never reported); tasks: that accuracy (ties: "
                   "perplexity); ppl: tuning perplexity alone (it may trade retrieval away)")
    p.add_argument("--tune-tasks", nargs="+", default=list(TUNE_TASKS), metavar="TASK",
                   help=f"tasks of the accuracy objective (default {' '.join(TUNE_TASKS)}: a needle in each kind of "
                   f"haystack — filler, facts, real prose; see eval_tasks)")
    p.add_argument("--tune-n", type=pos_int, default=4, help=f"tuning instances per task (default 4, at most "
                   f"{MAX_TUNE_N})")
    p.add_argument("--tune-length", type=pos_int, help="tuning instances' prompt tokens (default --seq-len, at "
                   "least 64, raised to hold every tuning task's prompt; a given one must hold them and fit the "
                   "model's positions, as eval_tasks --lengths must)")
    p.add_argument("--fit-length", type=pos_int, help="the prompt tokens at which the budget holds (default "
                   "--prompt-len; at most the model's positions): a store with a fixed-size part, KIVI's "
                   "full-precision window, fits more tokens "
                   "on a longer prompt; give the length the plan is for, e.g. the --tune-length")
    p.add_argument("--prefill", choices=("fast", "any"), default="fast", help="fast (default): with tuning "
                   "tasks, pick among the fast-prefill selectors (KVzip recon=local, snapkv, ObservedAttention "
                   "stride>=8: prefill + compression about one prefill) when one holds the tuning tasks, trying the "
                   "others only when none does; any: among all selectors, by the objective alone")
    p.add_argument("--tune-setting", choices=("agnostic", "aware"), default="agnostic",
                   help="the question after the compressed context (default) or inside it")
    p.add_argument("--task-tolerance", type=_nonneg_float, default=0.0, help="mixed: accuracy points below the "
                   "best a candidate may lose (default 0)")
    p.add_argument("--stories", help="prose for --tune-tasks that hide a needle in stories (default: the --calib "
                   "text when it is a local file)")
    p.add_argument("--out", required=True, help="the plan (.json); low-rank bases go beside it")
    p.add_argument("--json", help="also write the search report here")
    add_run_options(p, force_help="overwrite --out / --json (and recompute --calib-stats that lacks something)")
    return p


def options(args: argparse.Namespace) -> PlanOptions:
    """The typed options of a parsed command line."""
    return PlanOptions(
        model=args.model, calib=args.calib, out=args.out, tokenizer=args.tokenizer,
        budget_bytes_per_token=args.budget_bytes_per_token, ratio=args.ratio, calib_tokens=args.calib_tokens,
        calib_stats=args.calib_stats, tune_tokens=args.tune_tokens, seq_len=args.seq_len, prompt_len=args.prompt_len,
        selectors=tuple(args.selectors), stores=None if args.stores is None else tuple(args.stores),
        batch_size=args.batch_size, objective=args.objective, tune_tasks=tuple(args.tune_tasks), tune_n=args.tune_n,
        tune_length=args.tune_length, fit_length=args.fit_length, tune_setting=args.tune_setting,
        task_tolerance=args.task_tolerance, prefill=args.prefill, stories=args.stories, json=args.json,
        **run_option_values(args))


def check_lengths(opts: PlanOptions, max_positions: Optional[int]) -> int:
    """The window, its compressed prompt and ``--fit-length`` within the model's positions (``None``: no limit);
    returns the compressed prompt's length. A one-line :class:`UsageError` names the option."""
    seq = opts.seq_len
    if max_positions is not None and seq > max_positions:
        raise UsageError(f"--seq-len {seq} exceeds the model's {max_positions} positions")
    prompt_len = opts.window_prompt
    if not 1 <= prompt_len < seq:
        raise UsageError(f"--prompt-len must be in [1, {seq - 1}] (below --seq-len), got {prompt_len}")
    if opts.fit_length is not None and max_positions is not None and opts.fit_length > max_positions:
        raise UsageError(f"--fit-length {opts.fit_length} exceeds the model's {max_positions} positions: no prompt "
                         f"of that length runs on it (give at most {max_positions})")
    return prompt_len


def run(opts: PlanOptions) -> tuple[object, dict]:
    """Load, calibrate, search (:func:`kvsplice.planning.search.search`); returns the plan and its report."""
    from kvsplice.adapters import adapter_for, model_fingerprint
    from kvsplice.evaluation.protocol import full_bytes_per_token
    from kvsplice.loading import iter_texts, load_model, token_stream
    from kvsplice.lowrank.calibrate import calibration_batches
    from kvsplice.lowrank.sensitivity import stats_for
    from kvsplice.planning.search import SearchOptions, candidate_stores, search
    from kvsplice.planning.spec import Plan

    progress = opts.progress
    device, dtype = device_dtype(opts)
    loaded = load_model(opts.model, tokenizer=opts.tokenizer, dtype=dtype, device=device)
    model, seq = loaded.model, opts.seq_len
    prompt_len = check_lengths(opts, loaded.max_positions)
    vocab = adapter_for(model).param().shape[0]  # fp32 logits of a batch of windows: the forward's least
    check_fits(f"--batch-size {opts.batch_size} with --seq-len {seq}", 4 * opts.batch_size * seq * vocab,
               "a forward's logits", device)
    need = opts.calib_tokens + opts.tune_tokens
    ids, _ = token_stream(iter_texts(opts.calib, option="calib", split="train"), loaded.tokenizer, need,
                          progress=progress, desc="tokenize calib")
    if ids.numel() < need:  # never calibrate on fewer tokens than asked
        raise UsageError(f"--calib {opts.calib}: {ids.numel()} tokens, fewer than --calib-tokens {opts.calib_tokens} "
                         f"+ --tune-tokens {opts.tune_tokens} = {need}; give more text or smaller counts")
    n_cal = opts.calib_tokens
    if n_cal < seq or opts.tune_tokens < seq:
        raise UsageError(f"--calib-tokens {opts.calib_tokens} and --tune-tokens {opts.tune_tokens} must each hold a "
                         f"window of --seq-len {seq}")
    tune = ids[n_cal:n_cal + opts.tune_tokens]
    tune = tune[: (tune.numel() // seq) * seq].view(-1, seq)  # (N, T) tuning windows
    adapter = adapter_for(model)
    full_bpt = full_bytes_per_token(adapter)
    if opts.budget_bytes_per_token is not None and opts.budget_bytes_per_token >= full_bpt:
        raise UsageError(f"--budget-bytes-per-token {opts.budget_bytes_per_token:g} is at least the fp16 full cache's "
                         f"{full_bpt:g} bytes per token: nothing to compress; give a smaller budget")
    stores = [s for x in _store_specs(opts.stores) for s in
              (candidate_stores(adapter.has_rope, adapter.head_dim, rotary_dim=adapter.rotary_dim)
               if x == DEFAULT_STORES else [x])]
    # the tuning instances built and checked before the calibration (a bad --tune-length fails in seconds)
    task_eval, tune_info = _task_eval(opts, model, loaded.tokenizer, seq, progress, loaded.max_positions)
    t0 = time.perf_counter()
    stats, reused = None, False
    if any(isinstance(s.get("bases"), dict) for s in stores):  # the planner's low-rank fits need statistics
        stats, reused = stats_for(model, lambda: calibration_batches(ids[:n_cal], seq, opts.batch_size),
                                  path=opts.calib_stats, ropes=("pre", "post"), source={
                                      "calibration_source": str(opts.calib), "calibration_tokens": n_cal,
                                      "seq_len": seq}, progress=progress, replace=opts.force)
    elif opts.calib_stats is not None:
        print(f"note: --calib-stats {opts.calib_stats}: no low-rank store is searched (--stores), so nothing is "
              f"calibrated and the file is neither read nor written", file=sys.stderr)
    calib_s = time.perf_counter() - t0
    budget = opts.budget_bytes_per_token or full_bpt / opts.ratio
    from tqdm.auto import tqdm

    log = tqdm.write if progress else (lambda s: None)  # lines above the tuning tasks' bar, not inside it
    search_opts = SearchOptions(prompt_len=prompt_len, budget=budget, selectors=opts.selectors,
                                stores=tuple(stores), batch_size=opts.batch_size, objective=opts.objective,
                                task_tolerance=opts.task_tolerance, fit_len=opts.fit_length, prefill=opts.prefill)
    try:
        found = search(model, stats, tune, search_opts, task_eval=task_eval, tokenizer=loaded.tokenizer, log=log)
    finally:
        if task_eval is not None:
            task_eval.close()
    best, chosen = found["best"], found["chosen"]
    info = {"budget": {"bytes_per_token": budget, "ratio_vs_fp16_full": full_bpt / budget,
                       "full_fp16_bytes_per_token": full_bpt, "storage": "fp16",
                       "prompt_len": opts.fit_length or prompt_len},
            "prompt_len": prompt_len, "seq_len": seq,
            "tuning": {"source": str(opts.calib), "after_calibration_tokens": n_cal, "windows": tune.shape[0],
                       "full_cache_ppl": found["full"]["tuning_ppl"]},
            "calibration": {"tokens": n_cal, "stats_file": opts.calib_stats if stats is not None else None,
                            "reused": reused, "seconds": calib_s},
            "chosen": chosen, "selector": found["selector"], "selectors_left_out": found["selectors_left_out"],
            "prefill": opts.prefill, "candidates": found["candidates"],
            "objective": opts.objective, "tasks": tune_info, "full": found["full"]}
    plan = Plan(best, model_fingerprint(model), None, info)
    return plan, info


def _task_eval(opts: PlanOptions, model, tokenizer, seq: int, progress: bool, max_positions: Optional[int] = None):
    """The accuracy objective's measure: candidates on tuning task instances (seeds from
    :data:`kvsplice.tasks.suite.TUNING_SEED0`, disjoint from any reported run), each instance's prefill made once
    for every candidate (:class:`~kvsplice.tasks.tuning.TuningTasks`). The instances pass the bound check
    ``eval_tasks --lengths`` makes (:func:`kvsplice.tasks.suite.check_instances`)."""
    if opts.objective == "ppl":
        return None, None
    from kvsplice.tasks.suite import MIN_LENGTH, TUNING_SEED0, check_instances, fitting_instances, make_instances
    from kvsplice.tasks.tuning import TuningTasks

    length = opts.tune_length or max(seq, MIN_LENGTH)
    if max_positions is not None and length > max_positions:
        raise UsageError(f"--tune-length {length} exceeds the model's {max_positions} positions (give a shorter one, "
                         f"or --objective ppl)")
    stories = _stories(opts)
    given = "--tune-length" if opts.tune_length else f"--tune-length (default {length}, from --seq-len)"
    try:
        if opts.tune_length:
            insts = make_instances(opts.tune_tasks, tokenizer, [length], opts.tune_n, seed0=TUNING_SEED0,
                                   stories=stories)
        else:  # the default: long enough for every tuning task's prompt
            length, insts = fitting_instances(opts.tune_tasks, tokenizer, length, opts.tune_n, seed0=TUNING_SEED0,
                                              stories=stories)
        check_instances(insts, max_positions)
    except ValueError as e:
        raise UsageError(f"{given}: {e}") from None
    info = {"tasks": list(opts.tune_tasks), "length": length, "n": opts.tune_n, "seed0": TUNING_SEED0,
            "stories": stories, "setting": opts.tune_setting}

    return TuningTasks(model, tokenizer, insts, setting=opts.tune_setting, progress=progress), info


def _check_tune_tasks(opts: PlanOptions) -> None:
    """``--tune-tasks`` known and given the text they need (before the model loads)."""
    if opts.objective == "ppl":
        return
    from kvsplice.tasks.suite import NEEDS_STORIES, TASKS

    bad = [t for t in opts.tune_tasks if t not in TASKS]
    if bad:
        raise UsageError(f"--tune-tasks: unknown task {bad[0]!r}; tasks are {', '.join(TASKS)}")
    if set(opts.tune_tasks) & NEEDS_STORIES and not _stories(opts):
        raise UsageError("--tune-tasks " + " ".join(sorted(set(opts.tune_tasks) & NEEDS_STORIES)) + " need --stories "
                         f"(a local text file; --calib {opts.calib} is not one)")


def _stories(opts: PlanOptions) -> Optional[str]:
    """The prose of the tuning tasks that hide a needle in stories: ``--stories``, else the calibration text when it
    is a local file (never the text instances are reported on)."""
    if opts.stories:
        return opts.stories
    return opts.calib if Path(opts.calib).expanduser().is_file() else None


def _store_specs(given: Optional[Sequence[str]]) -> list:
    """``--stores`` checked before the model loads (:func:`kvsplice.planning.candidates.store_specs`); a bad one is a
    one-line :class:`UsageError`."""
    from kvsplice.planning.candidates import store_specs

    try:
        return store_specs(given)
    except ValueError as e:
        raise UsageError(str(e)) from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    from kvsplice.loading import LoadError
    from kvsplice.planning.spec import PlanError

    return run_cli(PROG, lambda: _main(argv), (LoadError, PlanError))


def _main(argv: Optional[Sequence[str]]) -> int:
    opts = options(build_parser().parse_args(argv))
    if opts.threads:
        torch.set_num_threads(opts.threads)
    inputs = {"--model": opts.model, "--tokenizer": opts.tokenizer, "--calib": opts.calib,
              "--calib-stats": opts.calib_stats, "--stories": opts.stories,  # an existing stats file is an input
              "--stores": SpecArgs.of(opts.stores)}
    _store_specs(opts.stores)  # fail fast, before the model loads
    if opts.stories:
        from kvsplice.tasks.haystack import check_stories

        check_stories(opts.stories, "--stories")  # text, as every command's text reader checks it
    _check_tune_tasks(opts)
    out = output_file(opts.out, force=opts.force, inputs=inputs)
    bases_out = out.with_name(out.stem + ".bases.safetensors")
    # never an input, even with --force (whether it may replace an existing file is checked once the plan has bases)
    output_file(bases_out, force=True, option="the plan's bases", inputs=inputs, outputs={"--out": out})
    json_path = None if opts.json is None else output_file(opts.json, force=opts.force, option="--json",
                                                           inputs=inputs, outputs={"--out": out,
                                                                                   "the plan's bases": bases_out})
    cache_file(opts.calib_stats, option="--calib-stats", inputs=inputs,
               outputs={"--out": out, "the plan's bases": bases_out, **({"--json": json_path} if json_path else {})})
    plan, info = run(opts)
    if plan.files():
        output_file(bases_out, force=opts.force, option="the plan's bases", inputs=inputs)
    report = {} if json_path is None else {json_path: lambda tmp: tmp.write_text(
        json.dumps(info, indent=2, default=str) + "\n")}
    plan.save(out, also=report)  # the plan, its bases and the report replace earlier ones together
    c = info["chosen"]
    acc = "" if "task_acc" not in c else (f"; tuning task accuracy {c['task_acc']:.1f} % (full cache "
                                           f"{info['full']['task_acc']:.1f} %)")
    size = f"{c['bytes_per_token']:.1f} bytes per token, {c['ratio_vs_fp16_full']:.2f}x smaller than the fp16 full cache"
    if "at_fit" in c:  # fitted at --fit-length: the size there, then on the tuning windows' prompts
        f = c["at_fit"]
        size = (f"{f['bytes_per_token']:.1f} bytes per token, {f['ratio_vs_fp16_full']:.2f}x smaller than the fp16 "
                f"full cache at {f['prompt_len']} tokens ({c['ratio_vs_fp16_full']:.2f}x at {info['prompt_len']})")
    print(f"plan: {c['label']} — {size}; tuning ppl {c['tuning_ppl']:.4f} ({c['delta_pct']:+.2f} % vs the full cache "
          f"{info['tuning']['full_cache_ppl']:.4f}){acc} [objective {opts.objective}]")
    print(f"wrote {out}" + (f" and {bases_out}" if plan.files() else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

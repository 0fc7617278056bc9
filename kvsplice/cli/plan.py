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
above the full cache is refused: nothing to compress; one below what the smallest candidate reaches too, both
judged from the model's shapes before any text is read). A ``--calib`` text with fewer tokens than ``--calib-tokens``
+ ``--tune-tokens`` is refused (never calibrated on what there is); ``--stories`` must be text (the check every
command's text reader makes). Errors: one line, exit status 2; ``--out`` is never overwritten without ``--force``.
"""

from __future__ import annotations

from kvsplice.io.interrupt import quiet_interrupts_while_importing

PROG = "kvsplice plan"
quiet_interrupts_while_importing(__name__, PROG)  # Ctrl-C during the imports below: one line, exit 130

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from kvsplice.core.limits import check_fits
from kvsplice.io.cli import UsageError, device_dtype, run_cli
from kvsplice.io.files import cache_file, output_file
from kvsplice.io.inputs import SpecArgs
from kvsplice.io.options import from_args
from kvsplice.io.run_options import run_parser
from kvsplice.planning.candidates import DEFAULT_STORES
from kvsplice.planning.options import PlanOptions


def build_parser() -> argparse.ArgumentParser:
    """The command line of :class:`PlanOptions` (its fields declare it) and the run options."""
    return run_parser(PROG, PlanOptions, description="Search the compression stack (token selection × low rank × "
                      "bits) that fits a KV-cache budget with the least loss on calibration text; write a plan.",
                      force_help="overwrite --out / --json (and recompute --calib-stats that lacks something)")


def check_lengths(opts: PlanOptions, seq: int, max_positions: Optional[int]) -> int:
    """The window ``seq``, its compressed prompt, ``--fit-length`` and a given ``--tune-length`` within the model's
    positions (``None``: no limit); returns the compressed prompt's length. A one-line :class:`UsageError` names the
    option."""
    if max_positions is not None and seq > max_positions:
        raise UsageError(f"--seq-len {seq} exceeds the model's {max_positions} positions")
    prompt_len = opts.window_prompt(seq)
    if not 1 <= prompt_len < seq:
        raise UsageError(f"--prompt-len must be in [1, {seq - 1}] (below --seq-len), got {prompt_len}")
    if opts.fit_length is not None and max_positions is not None and opts.fit_length > max_positions:
        raise UsageError(f"--fit-length {opts.fit_length} exceeds the model's {max_positions} positions: no prompt "
                         f"of that length runs on it (give at most {max_positions})")
    if opts.objective != "ppl" and opts.tune_length and max_positions is not None and opts.tune_length > max_positions:
        raise UsageError(f"--tune-length {opts.tune_length} exceeds the model's {max_positions} positions (give a "
                         f"shorter one, or --objective ppl)")
    return prompt_len


def check_budget(opts: PlanOptions, adapter, stores: list, fit_len: int) -> float:
    """The budget in bytes per prompt token: below the fp16 full cache's and at least what the smallest candidate
    reaches at ``fit_len`` prompt tokens (:func:`~kvsplice.planning.candidates.least_bytes_per_token`), both judged
    from the model's shapes before any calibration; a one-line :class:`UsageError` names the option."""
    from kvsplice.evaluation.protocol import full_bytes_per_token
    from kvsplice.planning.candidates import least_bytes_per_token

    full_bpt = full_bytes_per_token(adapter)
    given = (f"--budget-bytes-per-token {opts.budget_bytes_per_token:g}" if opts.budget_bytes_per_token is not None
             else f"--ratio {opts.ratio:g}")
    if opts.budget_bytes_per_token is not None and opts.budget_bytes_per_token >= full_bpt:
        raise UsageError(f"{given} is at least the fp16 full cache's {full_bpt:g} bytes per token: nothing to "
                         f"compress; give a smaller budget")
    budget = opts.budget_bytes_per_token or full_bpt / opts.ratio
    least = least_bytes_per_token(stores, adapter, fit_len)
    if budget < least:
        raise UsageError(f"{given}: no stack fits {budget:.3g} bytes per token: the smallest candidate keeps 1/64 of "
                         f"a {fit_len}-token prompt in at least {least:.3g} ({full_bpt / least:.0f}x smaller than the "
                         f"fp16 full cache's {full_bpt:g}); give a larger budget")
    return budget


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
    model, seq = loaded.model, opts.window(loaded.max_positions)
    prompt_len = check_lengths(opts, seq, loaded.max_positions)
    adapter = adapter_for(model)
    stores = [s for x in _store_specs(opts.stores) for s in
              (candidate_stores(adapter.has_rope, adapter.head_dim, rotary_dim=adapter.rotary_dim)
               if x == DEFAULT_STORES else [x])]
    budget = check_budget(opts, adapter, stores, opts.fit_length or prompt_len)  # before any text is read
    full_bpt = full_bytes_per_token(adapter)
    vocab = adapter.param().shape[0]  # fp32 logits of a batch of windows: the forward's least
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
        else:  # the default: long enough for every tuning task's prompt, short enough for its answer
            length, insts = fitting_instances(opts.tune_tasks, tokenizer, length, opts.tune_n, seed0=TUNING_SEED0,
                                              stories=stories)
            room = max((i.max_new_tokens for i in insts), default=0)
            if max_positions is not None and length + room > max_positions and length == max(seq, MIN_LENGTH):
                length, insts = fitting_instances(opts.tune_tasks, tokenizer, max_positions - room, opts.tune_n,
                                                  seed0=TUNING_SEED0, stories=stories)
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
    opts = from_args(PlanOptions, build_parser().parse_args(argv))
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

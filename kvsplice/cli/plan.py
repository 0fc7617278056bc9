"""The budget planner: find the compression stack (tokens × rank × bits) that fits a cache budget and loses the least
on calibration text, and write it as a plan the other tools take directly.

    python -m kvsplice.plan --model DIR|GGUF|CKPT --calib TEXT (--budget-bytes-per-token N | --ratio R) \\
        [--calib-tokens 32768] [--calib-stats STATS.safetensors] [--tune-tokens 2048] [--prompt-len P] \\
        [--seq-len T] [--selectors snapkv kvzip 'kvzip(mix=observed_attention,share=0.5)'] [--stores default SPEC ...] \\
        [--device DEV] \\
        [--objective ppl|tasks|mixed] [--tune-tasks passkey niah_number_facts niah_number_stories] [--tune-n 4] \\
        [--stories TEXT] \\
        [--dtype fp32|bf16|fp16] \\
        --out plan.json [--force] [--json REPORT.json]

    python -m kvsplice.generate --model M --plan plan.json --prompt "..." --max-new-tokens 64
    python -m kvsplice.eval_bases --model M --plan plan.json --data VAL.txt
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
import math
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from kvsplice.io.cli import Parser, UsageError, add_device_dtype, device_dtype, help_text, pos_int, run_cli
from kvsplice.io.outputs import SpecArgs, cache_file, output_file, write_json

DEFAULT_STORES = "default"
"""``--stores default``: the built-in candidate stores (:func:`kvsplice.planning.search.candidate_stores`)."""
TUNE_TASKS = ("passkey", "niah_number_facts", "niah_number_stories")
"""The accuracy objective's default tasks: a number hidden in filler, in encyclopedic facts and in real prose (the
calibration text's; :func:`_stories`)."""


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
    except (ValueError, TypeError) as e:
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
    p.add_argument("--calib-tokens", type=pos_int, default=32768, help="calibration tokens (default 32768)")
    p.add_argument("--calib-stats", help="calibration statistics: reused when the file exists, written otherwise")
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
    p.add_argument("--tune-n", type=pos_int, default=4, help="tuning instances per task (default 4)")
    p.add_argument("--tune-length", type=pos_int, help="tuning instances' prompt tokens (default --seq-len, at "
                   "least 64)")
    p.add_argument("--fit-length", type=pos_int, help="the prompt tokens at which the budget holds (default "
                   "--prompt-len): a store with a fixed-size part, KIVI's full-precision window, fits more tokens "
                   "on a longer prompt; give the length the plan is for, e.g. the --tune-length")
    p.add_argument("--tune-setting", choices=("agnostic", "aware"), default="agnostic",
                   help="the question after the compressed context (default) or inside it")
    p.add_argument("--task-tolerance", type=_nonneg_float, default=0.0, help="mixed: accuracy points below the "
                   "best a candidate may lose (default 0)")
    p.add_argument("--stories", help="prose for --tune-tasks that hide a needle in stories (default: the --calib "
                   "text when it is a local file)")
    p.add_argument("--out", required=True, help="the plan (.json); low-rank bases go beside it")
    p.add_argument("--json", help="also write the search report here")
    p.add_argument("--force", action="store_true", help="overwrite --out / --json (and recompute --calib-stats "
                   "that lacks something)")
    p.add_argument("--threads", type=pos_int)
    p.add_argument("--no-progress", action="store_true")
    add_device_dtype(p)
    return p


def run(args: argparse.Namespace) -> tuple[object, dict]:
    from kvsplice.adapters import adapter_for, model_fingerprint
    from kvsplice.evaluation.protocol import full_bytes_per_token
    from kvsplice.loading import iter_texts, load_model, token_stream
    from kvsplice.lowrank.calibrate import calibration_batches
    from kvsplice.lowrank.sensitivity import stats_for
    from kvsplice.planning.search import candidate_stores, search
    from kvsplice.planning.spec import Plan

    progress = not args.no_progress
    device, dtype = device_dtype(args)
    loaded = load_model(args.model, tokenizer=args.tokenizer, dtype=dtype, device=device)
    model, seq = loaded.model, args.seq_len
    if loaded.max_positions is not None and seq > loaded.max_positions:
        raise UsageError(f"--seq-len {seq} exceeds the model's {loaded.max_positions} positions")
    prompt_len = args.prompt_len or (3 * seq) // 4
    if not 1 <= prompt_len < seq:
        raise UsageError(f"--prompt-len must be in [1, {seq - 1}] (below --seq-len), got {prompt_len}")
    need = args.calib_tokens + args.tune_tokens
    ids, _ = token_stream(iter_texts(args.calib, option="calib", split="train"), loaded.tokenizer, need,
                          progress=progress, desc="tokenize calib")
    if ids.numel() < need:  # never calibrate on fewer tokens than asked
        raise UsageError(f"--calib {args.calib}: {ids.numel()} tokens, fewer than --calib-tokens {args.calib_tokens} "
                         f"+ --tune-tokens {args.tune_tokens} = {need}; give more text or smaller counts")
    n_cal = args.calib_tokens
    if n_cal < seq or args.tune_tokens < seq:
        raise UsageError(f"--calib-tokens {args.calib_tokens} and --tune-tokens {args.tune_tokens} must each hold a "
                         f"window of --seq-len {seq}")
    tune = ids[n_cal:n_cal + args.tune_tokens]
    tune = tune[: (tune.numel() // seq) * seq].view(-1, seq)  # (N, T) tuning windows
    adapter = adapter_for(model)
    full_bpt = full_bytes_per_token(adapter)
    if args.budget_bytes_per_token is not None and args.budget_bytes_per_token >= full_bpt:
        raise UsageError(f"--budget-bytes-per-token {args.budget_bytes_per_token:g} is at least the fp16 full cache's "
                         f"{full_bpt:g} bytes per token: nothing to compress; give a smaller budget")
    stores = [s for x in _store_specs(args.stores) for s in
              (candidate_stores(adapter.has_rope, adapter.head_dim, rotary_dim=adapter.rotary_dim)
               if x == DEFAULT_STORES else [x])]
    # the tuning instances built and checked before the calibration (a bad --tune-length fails in seconds)
    task_eval, tune_info = _task_eval(args, model, loaded.tokenizer, seq, progress, loaded.max_positions)
    t0 = time.perf_counter()
    stats, reused = None, False
    if any(isinstance(s.get("bases"), dict) for s in stores):  # the planner's low-rank fits need statistics
        stats, reused = stats_for(model, lambda: calibration_batches(ids[:n_cal], seq, args.batch_size),
                                  path=args.calib_stats, ropes=("pre", "post"), source={
                                      "calibration_source": str(args.calib), "calibration_tokens": n_cal,
                                      "seq_len": seq}, progress=progress, replace=args.force)
    calib_s = time.perf_counter() - t0
    budget = args.budget_bytes_per_token or full_bpt / args.ratio
    from tqdm.auto import tqdm

    log = tqdm.write if progress else (lambda s: None)  # lines above the tuning tasks' bar, not inside it
    found = search(model, stats, tune, prompt_len=prompt_len, budget=budget, selectors=args.selectors,
                   stores=stores, batch_size=args.batch_size, log=log, objective=args.objective,
                   task_eval=task_eval, task_tolerance=args.task_tolerance, tokenizer=loaded.tokenizer,
                   fit_len=args.fit_length)
    if task_eval is not None:
        task_eval.close()
    best, chosen = found["best"], found["chosen"]
    info = {"budget": {"bytes_per_token": budget, "ratio_vs_fp16_full": full_bpt / budget,
                       "full_fp16_bytes_per_token": full_bpt, "storage": "fp16",
                       "prompt_len": args.fit_length or prompt_len},
            "prompt_len": prompt_len, "seq_len": seq,
            "tuning": {"source": str(args.calib), "after_calibration_tokens": n_cal, "windows": tune.shape[0],
                       "full_cache_ppl": found["full"]["tuning_ppl"]},
            "calibration": {"tokens": n_cal, "stats_file": args.calib_stats, "reused": reused,
                            "seconds": calib_s},
            "chosen": chosen, "selector": found["selector"], "candidates": found["candidates"],
            "objective": args.objective, "tasks": tune_info, "full": found["full"]}
    plan = Plan(best, model_fingerprint(model), None, info)
    return plan, info


def _task_eval(args, model, tokenizer, seq: int, progress: bool, max_positions: Optional[int] = None):
    """The accuracy objective's measure: candidates on tuning task instances (seeds from
    :data:`kvsplice.tasks.suite.TUNING_SEED0`, disjoint from any reported run), each instance's prefill made once
    for every candidate (:class:`~kvsplice.tasks.tuning.TuningTasks`)."""
    if args.objective == "ppl":
        return None, None
    from kvsplice.tasks.suite import MIN_LENGTH, TUNING_SEED0, check_positions, make_instances
    from kvsplice.tasks.tuning import TuningTasks

    length = args.tune_length or max(seq, MIN_LENGTH)
    if max_positions is not None and length > max_positions:
        raise UsageError(f"--tune-length {length} exceeds the model's {max_positions} positions (give a shorter one, "
                         f"or --objective ppl)")
    stories = _stories(args)
    insts = make_instances(args.tune_tasks, tokenizer, [length], args.tune_n, seed0=TUNING_SEED0, stories=stories)
    try:
        check_positions(insts, max_positions)
    except ValueError as e:
        raise UsageError(f"--tune-length: {e}") from None
    info = {"tasks": args.tune_tasks, "length": length, "n": args.tune_n, "seed0": TUNING_SEED0, "stories": stories,
            "setting": args.tune_setting}

    return TuningTasks(model, tokenizer, insts, setting=args.tune_setting, progress=progress), info


def _check_tune_tasks(args) -> None:
    """``--tune-tasks`` known and given the text they need (before the model loads)."""
    if args.objective == "ppl":
        return
    from kvsplice.tasks.suite import NEEDS_STORIES, TASKS

    bad = [t for t in args.tune_tasks if t not in TASKS]
    if bad:
        raise UsageError(f"--tune-tasks: unknown task {bad[0]!r}; tasks are {', '.join(TASKS)}")
    if set(args.tune_tasks) & NEEDS_STORIES and not _stories(args):
        raise UsageError("--tune-tasks " + " ".join(sorted(set(args.tune_tasks) & NEEDS_STORIES)) + " need --stories "
                         f"(a local text file; --calib {args.calib} is not one)")


def _stories(args) -> Optional[str]:
    """The prose of the tuning tasks that hide a needle in stories: ``--stories``, else the calibration text when it
    is a local file (never the text instances are reported on)."""
    if args.stories:
        return args.stories
    return args.calib if Path(args.calib).expanduser().is_file() else None


def _store_specs(given: Optional[Sequence[str]]) -> list:
    """``--stores``: each a storage method's spec (checked: before the model loads) or ``"default"`` (the built-in
    candidates, :func:`kvsplice.planning.search.candidate_stores`)."""
    from kvsplice.core.registry import METHODS, check_spec, load_spec
    from kvsplice.core.spec_files import rebased

    out: list = []
    for text in given or [DEFAULT_STORES]:
        if text == DEFAULT_STORES:
            out.append(text)
            continue
        spec, base_dir = load_spec(text)  # the short form, inline JSON or a .json spec file (as --method)
        spec = check_spec(spec if base_dir is None else rebased(spec, base_dir))
        if not METHODS[spec["name"]].is_storage:
            raise UsageError(f"--stores {text}: {spec['name']} is not a storage method (it cannot hold a token "
                             f"selection); storage methods: {', '.join(n for n, c in METHODS.items() if c.is_storage)}")
        out.append(spec)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    from kvsplice.loading import LoadError
    from kvsplice.planning.spec import PlanError

    return run_cli(PROG, lambda: _main(argv), (LoadError, PlanError))


def _main(argv: Optional[Sequence[str]]) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    inputs = {"--model": args.model, "--tokenizer": args.tokenizer, "--calib": args.calib,
              "--calib-stats": args.calib_stats, "--stories": args.stories,  # an existing stats file is an input
              "--stores": SpecArgs.of(args.stores)}
    _store_specs(args.stores)  # fail fast, before the model loads
    if args.stories:
        from kvsplice.tasks.haystack import check_stories

        check_stories(args.stories, "--stories")  # text, as every command's text reader checks it
    _check_tune_tasks(args)
    out = output_file(args.out, force=args.force, inputs=inputs)
    bases_out = out.with_name(out.stem + ".bases.safetensors")
    # never an input, even with --force (whether it may replace an existing file is checked once the plan has bases)
    output_file(bases_out, force=True, option="the plan's bases", inputs=inputs, outputs={"--out": out})
    json_path = None if args.json is None else output_file(args.json, force=args.force, option="--json",
                                                           inputs=inputs, outputs={"--out": out,
                                                                                   "the plan's bases": bases_out})
    cache_file(args.calib_stats, option="--calib-stats", inputs=inputs,
               outputs={"--out": out, "the plan's bases": bases_out, **({"--json": json_path} if json_path else {})})
    plan, info = run(args)
    if plan.files():
        output_file(bases_out, force=args.force, option="the plan's bases", inputs=inputs)
    plan.save(out)
    c = info["chosen"]
    acc = "" if "task_acc" not in c else (f"; tuning task accuracy {c['task_acc']:.1f} % (full cache "
                                           f"{info['full']['task_acc']:.1f} %)")
    size = f"{c['bytes_per_token']:.1f} bytes per token, {c['ratio_vs_fp16_full']:.2f}x smaller than the fp16 full cache"
    if "at_fit" in c:  # fitted at --fit-length: the size there, then on the tuning windows' prompts
        f = c["at_fit"]
        size = (f"{f['bytes_per_token']:.1f} bytes per token, {f['ratio_vs_fp16_full']:.2f}x smaller than the fp16 "
                f"full cache at {f['prompt_len']} tokens ({c['ratio_vs_fp16_full']:.2f}x at {info['prompt_len']})")
    print(f"plan: {c['label']} — {size}; tuning ppl {c['tuning_ppl']:.4f} ({c['delta_pct']:+.2f} % vs the full cache "
          f"{info['tuning']['full_cache_ppl']:.4f}){acc} [objective {args.objective}]")
    print(f"wrote {out}" + (f" and {bases_out}" if plan.files() else ""))
    if json_path is not None:
        write_json(info, json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

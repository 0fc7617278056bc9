"""Evaluate compression methods on generated long-context tasks: accuracy per task and length beside the full cache's,
and the cache bytes measured.

    python -m kvsplice.eval_tasks --model M (--plan P [P ...] | --method SPEC [SPEC ...]) [--tasks T ...] \\
        [--lengths 1024 2048] [--n 16] [--setting agnostic|aware|both] [--stories TINYSTORIES.txt] \\
        [--door decoder|hf] [--seed0 0] --out results.json [--md table.md] [--force] [--no-progress]

Tasks (``kvsplice.tasks``, generated from seeds ``--seed0 ..``, lengths in the model's tokens): passkey, single
needles (number / word / uuid in filler, stories or encyclopedic facts), multi-key, multi-value, multi-query,
variable tracking, common words, story QA. Methods: ``--plan`` files from ``python -m kvsplice.plan`` and ``--method``
specs (:mod:`kvsplice.tasks.methods`: ``int8``, ``kivi4``, ``select:observed_attention@x4+int8``, ``select:kvzip@x4``, ...);
the full cache is always run beside them. Settings: query-**agnostic** (context compressed, then the question) and
query-**aware** (the question compressed with the context). Greedy answers, exact-match scores.

``--out`` is resumable: rerun the same command and the finished instances are kept (the file is rewritten
atomically after every instance). The file records every setting that determines its answers; a rerun with another
model, tokenizer, stories text, door or dtype is refused, and one with other tasks, lengths, seeds or settings only
when it adds instances (:mod:`kvsplice.tasks.resume`; docs/eval_tasks_resume.md); ``--force`` starts over.
A length must hold each task's prompt: a length shorter than a task's shortest prompt is refused, naming it.
The ``decoder`` door shares one exact prefill between the full cache and every token selection
(:func:`kvsplice.tasks.shared.answer_many`); ``--door hf`` runs each method through transformers' ``generate()``.
"""

from __future__ import annotations

from kvsplice.io.interrupt import quiet_interrupts_while_importing

PROG = "kvsplice eval-tasks"
quiet_interrupts_while_importing(__name__, PROG)  # Ctrl-C during the imports below: one line, exit 130

import argparse
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from kvsplice.io.cli import Parser, UsageError, add_device_dtype, device_dtype, pos_int, run_cli
from kvsplice.io.outputs import SpecArgs, output_file, write_json
from kvsplice.tasks.results_schema import FORMAT


def build_parser() -> argparse.ArgumentParser:
    from kvsplice.tasks.suite import TASKS

    p = Parser(prog=PROG, description="Accuracy of compressed KV caches on generated "
               "long-context tasks (retrieval, multi-hop, aggregation, QA), beside the full cache's.")
    p.add_argument("--model", required=True, help="model directory, .gguf file, training .ckpt or Hub id")
    p.add_argument("--tokenizer", help="override the model's tokenizer")
    p.add_argument("--plan", nargs="+", default=[], help="plans from python -m kvsplice.plan")
    p.add_argument("--method", nargs="+", default=[], help="method specs: any kvsplice.build_method spec "
                   "(int8, kivi4, kivi_rotated(bits=4), select:NAME@KEEP[+STORE], lowrank:FILE+int8, spec.json), "
                   "kivi4h(residual=32), select:kvzip@x4+int8")
    p.add_argument("--tasks", nargs="+", default=["passkey", "niah_number_stories", "vartrack"],
                   choices=sorted(TASKS), metavar="TASK", help=f"tasks (default passkey niah_number_stories "
                   f"vartrack; all: {' '.join(TASKS)})")
    p.add_argument("--lengths", nargs="+", type=pos_int, default=[1024], help="prompt lengths in tokens (default "
                   "1024)")
    p.add_argument("--n", type=pos_int, default=8, help="instances per task and length (default 8)")
    p.add_argument("--seed0", type=int, default=0, help="first instance seed (default 0; tuning uses >= 1,000,000)")
    p.add_argument("--setting", choices=("agnostic", "aware", "both"), default="both",
                   help="query-agnostic, query-aware or both (default both)")
    p.add_argument("--stories", help="TinyStories text for the stories haystacks and story QA")
    p.add_argument("--door", choices=("decoder", "hf"), default="decoder", help="the package's Decoder (default; "
                   "one shared prefill for every selection) or transformers' generate()")
    p.add_argument("--out", required=True, help="results JSON (resumed when it exists)")
    p.add_argument("--md", help="also write the tables as markdown here")
    p.add_argument("--force", action="store_true", help="start --out over / overwrite --md")
    p.add_argument("--threads", type=pos_int)
    p.add_argument("--no-progress", action="store_true")
    add_device_dtype(p)
    return p


def _specs(args, tokenizer, model) -> dict:
    """``{spec: MethodSpec}`` of the full cache, ``--plan`` and ``--method`` (a plan — by either option — must be
    this model's)."""
    from kvsplice.tasks.methods import parse_method

    specs = {"full": parse_method("full")}
    for p in args.plan:
        if not Path(p).is_file():
            raise UsageError(f"--plan file not found: {p}")
        specs[f"plan:{p}"] = parse_method(f"plan:{p}", tokenizer, model)
    for s in args.method:
        if not s.strip():
            raise UsageError("--method is empty: give a method spec (e.g. int8, kivi4, select:snapkv@x4)")
        try:
            specs[s] = parse_method(s, tokenizer, model)
        except ValueError as e:
            raise UsageError(f"--method {e}") from None
    return specs


def _header(args, model, tok, specs: dict, insts: list, settings: tuple) -> dict:
    """What produced the output (:mod:`kvsplice.tasks.provenance`): every setting that determines its answers."""
    from kvsplice.adapters import model_fingerprint
    from kvsplice.tasks.provenance import file_digest, instance_digest, method_files, tokenizer_fingerprint
    from kvsplice.tasks.results_schema import VERSION

    return {"format": FORMAT, "version": VERSION, "model": args.model, "model_fingerprint": model_fingerprint(model),
            "tokenizer": args.tokenizer, "tokenizer_fingerprint": tokenizer_fingerprint(tok),
            "stories": args.stories, "stories_digest": file_digest(args.stories) if args.stories else None,
            "door": args.door, "dtype": args.dtype, "tasks": list(args.tasks), "lengths": list(args.lengths),
            "n": args.n, "seed0": args.seed0, "settings": list(settings),
            "instances": {i.key: instance_digest(tok, i) for i in insts},
            "methods": {k: s.label for k, s in specs.items()},
            "method_files": {k: method_files(list(s.files)) for k, s in specs.items()}}


def run(args: argparse.Namespace) -> dict:
    from kvsplice.loading import load_model
    from kvsplice.tasks.haystack import check_stories
    from kvsplice.tasks.instance import SETTINGS
    from kvsplice.tasks.report import markdown, summarize
    from kvsplice.tasks.resume import resume
    from kvsplice.tasks.runner import answer
    from kvsplice.tasks.shared import answer_many
    from kvsplice.tasks.suite import NEEDS_STORIES, TUNING_SEED0, check_lengths, check_positions, make_instances

    if args.seed0 < 0 or args.seed0 + args.n > TUNING_SEED0:
        raise UsageError(f"--seed0 {args.seed0}: reported instances use seeds 0 .. {TUNING_SEED0 - 1} (tuning "
                         f"uses the rest)")
    need = sorted(set(args.tasks) & NEEDS_STORIES)
    if need and not args.stories:
        raise UsageError(f"--tasks {' '.join(need)} need --stories (a TinyStories text file)")
    if args.stories:
        check_stories(args.stories, "--stories")
    device, dtype = device_dtype(args)
    loaded = load_model(args.model, tokenizer=args.tokenizer, dtype=dtype, device=device)
    model, tok = loaded.model, loaded.tokenizer
    if loaded.max_positions is not None and max(args.lengths) > loaded.max_positions:
        raise UsageError(f"--lengths {max(args.lengths)} exceeds the model's {loaded.max_positions} positions")
    specs = _specs(args, tok, model)
    from kvsplice.adapters.registry import adapter_for
    from kvsplice.decode.native import OWN_ATTENTION

    if adapter_for(model).name in OWN_ATTENTION and set(specs) != {"full"}:
        raise UsageError(f"--model {args.model} decodes with its own cache (a converted MLA model): --method full "
                         f"measures that cache; the compression methods need the source model")
    settings = SETTINGS if args.setting == "both" else (args.setting,)
    try:
        insts = make_instances(args.tasks, tok, args.lengths, args.n, seed0=args.seed0, stories=args.stories)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        check_lengths(insts)
        check_positions(insts, loaded.max_positions)
    except ValueError as e:
        raise UsageError(f"--lengths: {e}") from None
    header = _header(args, model, tok, specs, insts, settings)
    out = Path(args.out)
    from kvsplice.tasks.provenance import tokenizer_fingerprint

    results = resume(out, args.force, header, lambda doc: {"tokenizer_fingerprint": [tokenizer_fingerprint(
        tok, loaded_from=doc["tokenizer"] or doc["model"])]})  # files that hashed the path too
    jobs = [(s, i) for s in settings for i in insts]
    from tqdm.auto import tqdm

    bar = tqdm(jobs, desc="instances", disable=args.no_progress, file=sys.stderr)
    t0 = time.perf_counter()
    for setting, inst in bar:
        done = results.setdefault(setting, {}).setdefault(inst.key, {})
        todo = {k: s.factory for k, s in specs.items() if k not in done}
        if not todo:
            continue
        bar.set_postfix_str(f"{setting} {inst.key}")
        if args.door == "decoder":
            got = answer_many(model, tok, inst, todo, setting=setting)
        else:
            got = {k: answer(model, tok, inst, f, setting=setting, door="hf") for k, f in todo.items()}
        done.update({k: o.to_dict() for k, o in got.items()})
        write_json({**header, "results": results}, out)
    summary = summarize(results, list(specs))
    doc = {**header, "seconds": time.perf_counter() - t0, "summary": summary, "results": results}
    write_json(doc, out)
    doc["markdown"] = markdown(summary, header["methods"])
    return doc


def main(argv: Optional[Sequence[str]] = None) -> int:
    from kvsplice.loading import LoadError
    from kvsplice.planning.spec import PlanError

    return run_cli(PROG, lambda: _main(argv), (LoadError, PlanError))


def _main(argv: Optional[Sequence[str]]) -> int:
    args = build_parser().parse_args(argv)
    if not args.plan and not args.method:
        raise UsageError("give the methods to evaluate: --plan PLAN.json and/or --method SPEC (e.g. kivi4)")
    if args.threads:
        torch.set_num_threads(args.threads)
    inputs = {"--model": args.model, "--tokenizer": args.tokenizer, "--plan": args.plan, "--stories": args.stories,
              "--method": SpecArgs.of(args.method)}
    out = Path(args.out)
    if not out.exists() or args.force:
        output_file(args.out, force=args.force, inputs=inputs)
    else:
        output_file(args.out, force=True, inputs=inputs)  # resumed: still never an input, still writable
    md = None if args.md is None else output_file(args.md, force=args.force, option="--md", inputs=inputs,
                                                  outputs={"--out": out})
    doc = run(args)
    print(doc["markdown"])
    if md is not None:
        from models.checkpoint import atomic_write

        atomic_write(md, lambda p: p.write_text(doc["markdown"] + "\n"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

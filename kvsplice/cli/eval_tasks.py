"""Evaluate compression methods on generated long-context tasks: accuracy per task and length beside the full cache's,
and the cache bytes measured.

    kvsplice eval-tasks --model M (--plan P [P ...] | --method SPEC [SPEC ...]) [--tasks T ...] \\
        [--lengths 1024 2048] [--n 16] [--setting agnostic|aware|both] [--stories TINYSTORIES.txt] \\
        [--door decoder|hf] [--seed0 0] --out results.json [--md table.md] [--force] [--no-progress]

Tasks (``kvsplice.tasks``, generated from seeds ``--seed0 ..``, lengths in the model's tokens): passkey, single
needles (number / word / uuid in filler, stories or encyclopedic facts), multi-key, multi-value, multi-query,
variable tracking, common words, story QA. Methods: ``--plan`` files from ``kvsplice plan`` and ``--method``
specs (:mod:`kvsplice.tasks.methods`: ``int8``, ``kivi4``, ``select:observed_attention@x4+int8``, ``select:kvzip@x4``, ...);
the full cache is always run beside them. Settings: query-**agnostic** (context compressed, then the question) and
query-**aware** (the question compressed with the context). Greedy answers, exact-match scores.

``--out`` is resumable: rerun the same command and the finished instances are kept (the file is rewritten
atomically after every instance; a kept answer's score is recomputed from its recorded output, a hand-edited score
is corrected with a note). The file records every setting that determines its answers; a rerun with another
model, tokenizer, stories text, door or dtype is refused, and one with other tasks, lengths, seeds or settings only
when it adds instances (:mod:`kvsplice.tasks.resume`; docs/tasks.md, "Resuming --out"); ``--force`` starts over and
leaves the earlier file in place until the new run completes (its progress is written beside it,
``.<name>.<pid>.tmp``, and renamed over it at the end; Ctrl-C keeps the earlier file).
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

from kvsplice.io.cli import UsageError, device_dtype, run_cli
from kvsplice.io.files import output_file
from kvsplice.io.inputs import SpecArgs
from kvsplice.io.write import write_json
from kvsplice.io.options import from_args
from kvsplice.io.run_options import run_parser
from kvsplice.io.staged import Staged
from kvsplice.tasks.options import EvalTasksOptions
from kvsplice.tasks.results_schema import FORMAT


def build_parser() -> argparse.ArgumentParser:
    """The command line of :class:`EvalTasksOptions` (its fields declare it) and the run options."""
    return run_parser(PROG, EvalTasksOptions, description="Accuracy of compressed KV caches on generated "
                      "long-context tasks (retrieval, multi-hop, aggregation, QA), beside the full cache's.",
                      force_help="start --out over (the earlier file stays in place until the new run completes) / "
                      "overwrite --md")


def _header(opts: EvalTasksOptions, model, tok, specs: dict, insts: list) -> dict:
    """What produced the output (:mod:`kvsplice.tasks.provenance`): every setting that determines its answers."""
    from kvsplice.adapters import model_fingerprint
    from kvsplice.tasks.provenance import file_digest, instance_digest, method_files, tokenizer_fingerprint
    from kvsplice.tasks.results_schema import VERSION

    return {"format": FORMAT, "version": VERSION, "model": opts.model, "model_fingerprint": model_fingerprint(model),
            "tokenizer": opts.tokenizer, "tokenizer_fingerprint": tokenizer_fingerprint(tok),
            "stories": opts.stories, "stories_digest": file_digest(opts.stories) if opts.stories else None,
            "door": opts.door, "dtype": opts.dtype, "tasks": list(opts.tasks), "lengths": list(opts.lengths),
            "n": opts.n, "seed0": opts.seed0, "settings": list(opts.settings),
            "instances": {i.key: instance_digest(tok, i) for i in insts},
            "methods": {k: s.label for k, s in specs.items()},
            "method_files": {k: method_files(list(s.files)) for k, s in specs.items()}}


def run(opts: EvalTasksOptions) -> dict:
    """Answer every instance with every method (resuming ``opts.out``); returns the results document (and its
    ``markdown``). With ``force`` an existing ``out`` is replaced only when the run completes: until then the
    progress is written beside it (:class:`kvsplice.io.staged.Staged`)."""
    from kvsplice.loading import load_model
    from kvsplice.tasks.haystack import check_stories
    from kvsplice.tasks.methods import method_specs
    from kvsplice.tasks.report import markdown, summarize
    from kvsplice.tasks.resume import rederive, rescore, resume
    from kvsplice.tasks.runner import answer, decode_text
    from kvsplice.tasks.shared import answer_many
    from kvsplice.tasks.suite import NEEDS_STORIES, TUNING_SEED0, check_instances, make_instances

    if opts.seed0 < 0 or opts.seed0 + opts.n > TUNING_SEED0:
        raise UsageError(f"--seed0 {opts.seed0}: reported instances use seeds 0 .. {TUNING_SEED0 - 1} (tuning "
                         f"uses the rest)")
    need = sorted(set(opts.tasks) & NEEDS_STORIES)
    if need and not opts.stories:
        raise UsageError(f"--tasks {' '.join(need)} need --stories (a TinyStories text file)")
    if opts.stories:
        check_stories(opts.stories, "--stories")
    device, dtype = device_dtype(opts)
    loaded = load_model(opts.model, tokenizer=opts.tokenizer, dtype=dtype, device=device)
    model, tok = loaded.model, loaded.tokenizer
    if loaded.max_positions is not None and max(opts.lengths) > loaded.max_positions:
        raise UsageError(f"--lengths {max(opts.lengths)} exceeds the model's {loaded.max_positions} positions")
    specs = method_specs(opts.plans, opts.methods, tok, model)
    from kvsplice.adapters.registry import adapter_for
    from kvsplice.decode.native import OWN_ATTENTION

    if adapter_for(model).name in OWN_ATTENTION and set(specs) != {"full"}:
        raise UsageError(f"--model {opts.model} decodes with its own cache (a converted MLA model): --method full "
                         f"measures that cache; the compression methods need the source model")
    try:
        insts = make_instances(opts.tasks, tok, opts.lengths, opts.n, seed0=opts.seed0, stories=opts.stories)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        check_instances(insts, loaded.max_positions)
    except ValueError as e:
        raise UsageError(f"--lengths: {e}") from None
    header = _header(opts, model, tok, specs, insts)
    out = Path(opts.out)
    from kvsplice.tasks.provenance import tokenizer_fingerprint

    results = resume(out, opts.force, header, lambda doc: {"tokenizer_fingerprint": [tokenizer_fingerprint(
        tok, loaded_from=doc["tokenizer"] or doc["model"])]})  # files that hashed the path too
    rederive(results, insts, header["methods"], out, decode=lambda ids: decode_text(tok, ids),
             vocab=adapter_for(model).param().shape[0], max_positions=loaded.max_positions)
    rescore(results, insts, out)
    jobs = [(s, i) for s in opts.settings for i in insts]
    from tqdm.auto import tqdm

    with Staged([out] if opts.force and out.exists() else []) as staged:
        progress = staged.temp(out) if opts.force and out.exists() else out  # the earlier file stays until the end
        bar = tqdm(jobs, desc="instances", disable=not opts.progress, file=sys.stderr)
        t0 = time.perf_counter()
        for setting, inst in bar:
            done = results.setdefault(setting, {}).setdefault(inst.key, {})
            todo = {k: s.factory for k, s in specs.items() if k not in done}
            if not todo:
                continue
            bar.set_postfix_str(f"{setting} {inst.key}")
            if opts.door == "decoder":
                got = answer_many(model, tok, inst, todo, setting=setting)
            else:
                got = {k: answer(model, tok, inst, f, setting=setting, door="hf") for k, f in todo.items()}
            done.update({k: o.to_dict() for k, o in got.items()})
            write_json({**header, "results": results}, progress)
        summary = summarize(results, list(specs))
        doc = {**header, "seconds": time.perf_counter() - t0, "summary": summary, "results": results}
        write_json(doc, progress)
        staged.commit()
    doc["markdown"] = markdown(summary, header["methods"])
    return doc


def main(argv: Optional[Sequence[str]] = None) -> int:
    from kvsplice.loading import LoadError
    from kvsplice.planning.spec import PlanError

    return run_cli(PROG, lambda: _main(argv), (LoadError, PlanError))


def _main(argv: Optional[Sequence[str]]) -> int:
    opts = from_args(EvalTasksOptions, build_parser().parse_args(argv))
    if not opts.plans and not opts.methods:
        raise UsageError("give the methods to evaluate: --plan PLAN.json and/or --method SPEC (e.g. kivi4)")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    inputs = {"--model": opts.model, "--tokenizer": opts.tokenizer, "--plan": list(opts.plans),
              "--stories": opts.stories, "--method": SpecArgs.of(opts.methods)}
    out = Path(opts.out)
    if not out.exists() or opts.force:
        output_file(opts.out, force=opts.force, inputs=inputs)
    else:
        output_file(opts.out, force=True, inputs=inputs)  # resumed: still never an input, still writable
    md = None if opts.md is None else output_file(opts.md, force=opts.force, option="--md", inputs=inputs,
                                                  outputs={"--out": out})
    doc = run(opts)
    print(doc["markdown"])
    if md is not None:
        from models.checkpoint import atomic_write

        atomic_write(md, lambda p: p.write_text(doc["markdown"] + "\n"))
    print(f"wrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

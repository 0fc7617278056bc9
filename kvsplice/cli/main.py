"""The front door: ``kvsplice VERB [options]``, one console command for everything the package does.

``kvsplice --help`` lists the verbs one line each without importing torch; ``kvsplice VERB --help`` shows a verb's
options. Each verb is a module with ``main(argv) -> int``; the verb table names modules, so the training verbs
(which live in the ``training`` package, one layer above ``kvsplice``) are loaded by name, not imported here.
"""

from __future__ import annotations

from kvsplice.io.interrupt import quiet_interrupts_as_program

quiet_interrupts_as_program()  # the command's first instruction: Ctrl-C from here on is one line, exit 130

import importlib  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Callable, Optional, Sequence  # noqa: E402

__all__ = ["VERBS", "Verb", "main"]


@dataclass(frozen=True)
class Verb:
    """One verb: its module (``main(argv) -> int``), the group it is listed under, and its one-line summary."""

    module: str
    group: str
    summary: str


VERBS: dict[str, Verb] = {
    # train and measure models whose cache is small by design
    "train": Verb("training.fit", "train", "train a GPT-2 / MLA / MLA+KVSplice variant (LightningCLI: --config NAME)"),
    "evaluate": Verb("training.evaluate", "train", "a checkpoint's validation loss, real cache bytes, speed, samples"),
    "export": Verb("training.export", "train", "a checkpoint -> HF folder (remote code) or DeepSeek-V3 layout"),
    "distill": Verb("training.distill", "train", "fine-tune a converted MLA model (LM loss or KL to the source)"),
    "verify-memory": Verb("kvsplice.cli.verify_memory", "train", "measured cache bytes == the formula, per variant"),
    "bench-decode": Verb("kvsplice.cli.bench_decode", "train", "decode tokens/s and cache bytes per variant"),
    # compress a pretrained model's cache
    "generate": Verb("kvsplice.cli.generate", "compress", "generate with a compressed cache (--method SPEC)"),
    "plan": Verb("kvsplice.cli.plan", "compress", "search the best compression stack under a byte budget"),
    "eval-tasks": Verb("kvsplice.cli.eval_tasks", "compress", "long-context retrieval accuracy per method"),
    "fit-bases": Verb("kvsplice.cli.fit_bases", "compress", "fit low-rank KV bases (SVD family) on calibration text"),
    "eval-bases": Verb("kvsplice.cli.eval_bases", "compress", "perplexity and bytes of fitted bases on held-out text"),
    "bench-balance": Verb("kvsplice.cli.bench_balance", "compress", "token selectors compared at one budget"),
    # convert and serve
    "to-mla": Verb("kvsplice.cli.to_mla", "convert", "convert an MHA model (GPT-2, Llama family) to MLA / KVSplice"),
    "to-gguf": Verb("kvsplice.cli.to_gguf", "convert", "a DeepSeek-V3 export -> a GGUF llama.cpp runs"),
    "convert-llama2c": Verb("kvsplice.cli.convert_llama2c", "convert", "a llama2.c checkpoint -> a Llama folder"),
}

GROUPS = {"train": "train and measure", "compress": "compress a pretrained model's cache",
          "convert": "convert and serve"}


def usage() -> str:
    """The listing ``kvsplice --help`` prints: the verbs by group, one line each."""
    lines = ["usage: kvsplice VERB [options]      (kvsplice VERB --help: the verb's options)", ""]
    for group, title in GROUPS.items():
        lines.append(f"{title}:")
        lines += [f"  {name:<16}{v.summary}" for name, v in VERBS.items() if v.group == group]
        lines.append("")
    return "\n".join(lines)


def load(verb: str) -> Callable[[Optional[Sequence[str]]], int]:
    """The ``main`` of ``verb``'s module."""
    return importlib.import_module(VERBS[verb].module).main


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``kvsplice VERB [options]``: run the verb; no verb or ``--help``: the listing; an unknown verb: one line, 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if args[0] == "--version":
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"kvsplice {version('kvsplice')}")
        except PackageNotFoundError:
            print("kvsplice (not installed)")
        return 0
    verb = args[0]
    if verb not in VERBS:
        near = [v for v in VERBS if v.startswith(verb[:3])] or sorted(VERBS)
        print(f"kvsplice: error: unknown verb {verb!r} (verbs: {', '.join(near)}; kvsplice --help lists them)",
              file=sys.stderr)
        return 2
    if argv is None:  # the console command: Ctrl-C while the verb imports is one line (called with argv, a library
        from kvsplice.io.interrupt import quiet_interrupts_while_importing  # call changes no signal handling)

        quiet_interrupts_while_importing("__main__", f"kvsplice {verb}")
    return load(verb)(args[1:])


if __name__ == "__main__":
    sys.exit(main())

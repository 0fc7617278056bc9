"""``kvsplice convert-llama2c``: llama2.c checkpoint (+ tokenizer) → Hugging Face Llama directory."""

from __future__ import annotations

from kvsplice.io.interrupt import quiet_interrupts_while_importing

PROG = "kvsplice convert-llama2c"
quiet_interrupts_while_importing(__name__, PROG)  # Ctrl-C during the imports below: one line, exit 130

import argparse
import sys

from kvsplice.convert.llama2c import Llama2cFormatError, Llama2cOptions, convert_options
from kvsplice.io.cli import Parser, run_cli
from kvsplice.io.options import add_options, from_args


def build_parser() -> argparse.ArgumentParser:
    """The command line of :class:`Llama2cOptions` (its fields declare it); the outputs in their own group."""
    p = Parser(prog=PROG, description="Convert a llama2.c checkpoint (.bin, format v0/v1/v2) + tokenizer.bin into a "
               "Hugging Face LlamaForCausalLM directory (config.json, model.safetensors, tokenizer.json).")
    outputs = p.add_argument_group("outputs")
    add_options(p, Llama2cOptions, groups=dict.fromkeys(("out", "force"), outputs),
                help={"force": "write into an existing non-empty output directory (an earlier conversion's files "
                      "are replaced, its other files kept; a folder holding the input is refused)"})
    return p


def main(argv: list[str] | None = None) -> int:
    return run_cli(PROG, lambda: _main(argv), (Llama2cFormatError,))


def _main(argv: list[str] | None) -> int:
    opts = from_args(Llama2cOptions, build_parser().parse_args(argv))
    out, cfg, n_params = convert_options(opts)
    print(
        f"converted {opts.model} (llama2.c v{cfg['version']}) -> {out}: {n_params:,} params, "
        f"{cfg['n_layers']} layers, {cfg['n_heads']} heads, {cfg['n_kv_heads']} kv heads, dim {cfg['dim']}, "
        f"vocab {cfg['vocab_size']}, context {cfg['max_seq_len']}, tied={cfg['shared_classifier']}"
        + ("" if opts.tokenizer else " (weights only, no tokenizer)")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

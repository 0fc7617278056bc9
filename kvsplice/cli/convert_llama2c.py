"""``kvsplice convert-llama2c``: llama2.c checkpoint (+ tokenizer) → Hugging Face Llama directory."""

from __future__ import annotations

from kvsplice.io.interrupt import quiet_interrupts_while_importing

PROG = "kvsplice convert-llama2c"
quiet_interrupts_while_importing(__name__, PROG)  # Ctrl-C during the imports below: one line, exit 130

import sys

from kvsplice.convert.llama2c import Llama2cFormatError, _convert
from kvsplice.io.cli import Parser, add_output_options, run_cli


def main(argv: list[str] | None = None) -> int:
    return run_cli(PROG, lambda: _main(argv), (Llama2cFormatError,))


def _main(argv: list[str] | None) -> int:
    parser = Parser(
        prog=PROG,
        description="Convert a llama2.c checkpoint (.bin, format v0/v1/v2) + tokenizer.bin into a Hugging Face "
                    "LlamaForCausalLM directory (config.json, model.safetensors, tokenizer.json).",
    )
    parser.add_argument("model", help="llama2.c model .bin (e.g. stories260K.bin)")
    parser.add_argument("--tokenizer", help="llama2.c tokenizer .bin (e.g. tok512.bin); omit to convert weights only")
    add_output_options(parser, json=False, out_help="output directory",
                       force_help="write into an existing non-empty output directory (an earlier conversion's files "
                       "are replaced, its other files kept; a folder holding the input is refused)")
    args = parser.parse_args(argv)
    out, cfg, n_params = _convert(args.model, args.tokenizer, args.out, force=args.force)
    print(
        f"converted {args.model} (llama2.c v{cfg['version']}) -> {out}: {n_params:,} params, "
        f"{cfg['n_layers']} layers, {cfg['n_heads']} heads, {cfg['n_kv_heads']} kv heads, dim {cfg['dim']}, "
        f"vocab {cfg['vocab_size']}, context {cfg['max_seq_len']}, tied={cfg['shared_classifier']}"
        + ("" if args.tokenizer else " (weights only, no tokenizer)")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A DeepSeek-V3 export (``to_mla --format deepseek_v3``) → a GGUF that llama.cpp loads, by llama.cpp's own converter.

    kvsplice to-gguf DSV3_DIR --out model.gguf [--outtype f32|f16|bf16|q8_0]
    kvsplice to-gguf --fix model.gguf      # a GGUF you converted yourself with convert_hf_to_gguf.py

Runs ``convert_hf_to_gguf.py`` of the llama.cpp at ``$KVSPLICE_LLAMA_CPP`` (default ``build/engines/llama.cpp``)
unchanged, then the one post-step llama.cpp needs for a model without q-LoRA: the key
``deepseek2.attention.q_lora_rank = 0`` (:func:`kvsplice.convert.engines.llama_cpp.fix_gguf`; why: that module's
docstring). Errors are one line, exit 2; a full disk leaves the GGUF (``--out``, or the file ``--fix`` rewrites) as it
was and no temporary beside it. Temporaries get fresh names (``tempfile``) no file of the user's can have.
"""

from __future__ import annotations

from kvsplice.io.interrupt import quiet_interrupts_while_importing

PROG = "kvsplice to-gguf"
quiet_interrupts_while_importing(__name__, PROG)  # Ctrl-C during the imports below: one line, exit 130

import os
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from kvsplice.io.cli import Parser, UsageError, add_output_options, run_cli
from kvsplice.io.files import output_file
from kvsplice.io.write import disk_errors


def build_parser() -> Parser:
    p = Parser(prog=PROG, description="DeepSeek-V3 export -> llama.cpp GGUF (llama.cpp's "
               "converter + the q_lora_rank post-step).")
    p.add_argument("folder", nargs="?", help="a to_mla --format deepseek_v3 folder")
    add_output_options(p, json=False, out_required=False, out_help="the GGUF file to write",
                       force_help="overwrite --out")
    p.add_argument("--outtype", default="f32", choices=("f32", "f16", "bf16", "q8_0"),
                   help="weights' type in the GGUF (default f32)")
    p.add_argument("--fix", metavar="GGUF", help="only add the missing key to a GGUF converted by hand")
    return p


def _main(argv: Optional[Sequence[str]]) -> int:
    from kvsplice.convert.engines.llama_cpp import fix_gguf, hf_to_gguf
    from kvsplice.loading.checks import check_gguf_file, check_model_folder, gguf_header

    args = build_parser().parse_args(argv)
    if args.fix:
        if not Path(args.fix).is_file():
            raise UsageError(f"--fix {args.fix}: file not found")
        gguf_header(Path(args.fix))  # a damaged or truncated header: one line, before the reader meets it
        with disk_errors(args.fix):
            added = fix_gguf(args.fix)
        print(f"{args.fix}: " + (f"added {', '.join(added)}" if added else "nothing to add"))
        return 0
    if not args.folder or not args.out:
        raise UsageError("give a DeepSeek-V3 folder and --out FILE.gguf (or --fix FILE.gguf)")
    if not (Path(args.folder) / "config.json").is_file():
        raise UsageError(f"{args.folder}: no config.json (make one with to_mla --format deepseek_v3)")
    # never a file of the input folder, even with --force; written to a temporary sibling, then renamed into place
    out = output_file(args.out, force=args.force, inputs={"folder": args.folder})
    check_model_folder(Path(args.folder))  # config values and sizes against the weights: a GGUF that matches them
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        with disk_errors(out):
            added = hf_to_gguf(args.folder, tmp, outtype=args.outtype)
            check_gguf_file(tmp)  # what llama.cpp's converter wrote agrees with its own tensors
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, out)
    except RuntimeError as e:
        raise UsageError(str(e).splitlines()[0] + (" " + str(e).splitlines()[-1] if "\n" in str(e) else "")) from None
    finally:
        tmp.unlink(missing_ok=True)
    print(f"saved {out} ({args.outtype})" + (f"; post-step added {', '.join(added)}" if added else ""))
    return 0


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli(PROG, lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())

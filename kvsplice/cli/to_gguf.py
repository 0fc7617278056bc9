"""A DeepSeek-V3 export (``to_mla --format deepseek_v3``) → a GGUF that llama.cpp loads, by llama.cpp's own converter.

    kvsplice to-gguf DSV3_DIR --out model.gguf [--outtype f32|f16|bf16|q8_0]
    kvsplice to-gguf --fix model.gguf      # a GGUF you converted yourself with convert_hf_to_gguf.py

Runs ``convert_hf_to_gguf.py`` of the llama.cpp at ``$KVSPLICE_LLAMA_CPP`` (default ``build/engines/llama.cpp``)
unchanged, then the one post-step llama.cpp needs for a model without q-LoRA: the key
``deepseek2.attention.q_lora_rank = 0`` (:func:`kvsplice.convert.engines.gguf_convert.fix_gguf`; why: that module's
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

from kvsplice.convert.gguf_options import ToGGUFOptions
from kvsplice.io.cli import Parser, UsageError, run_cli
from kvsplice.io.files import output_file
from kvsplice.io.options import add_options, from_args
from kvsplice.io.write import disk_errors


def build_parser() -> Parser:
    """The command line of :class:`ToGGUFOptions` (its fields declare it); the outputs in their own group."""
    p = Parser(prog=PROG, description="DeepSeek-V3 export -> llama.cpp GGUF (llama.cpp's "
               "converter + the q_lora_rank post-step).")
    outputs = p.add_argument_group("outputs")
    add_options(p, ToGGUFOptions, groups=dict.fromkeys(("out", "force"), outputs), help={"force": "overwrite --out"})
    return p


def _main(argv: Optional[Sequence[str]]) -> int:
    from kvsplice.convert.engines.gguf_convert import fix_gguf, hf_to_gguf
    from kvsplice.loading.checks import check_gguf_file, check_model_folder, gguf_header

    opts = from_args(ToGGUFOptions, build_parser().parse_args(argv))
    if opts.fix:
        if not Path(opts.fix).is_file():
            raise UsageError(f"--fix {opts.fix}: file not found")
        gguf_header(Path(opts.fix))  # a damaged or truncated header: one line, before the reader meets it
        with disk_errors(opts.fix):
            added = fix_gguf(opts.fix)
        print(f"{opts.fix}: " + (f"added {', '.join(added)}" if added else "nothing to add"))
        return 0
    if not opts.folder or not opts.out:
        raise UsageError("give a DeepSeek-V3 folder and --out FILE.gguf (or --fix FILE.gguf)")
    if not (Path(opts.folder) / "config.json").is_file():
        raise UsageError(f"{opts.folder}: no config.json (make one with to_mla --format deepseek_v3)")
    # never a file of the input folder, even with --force; written to a temporary sibling, then renamed into place
    out = output_file(opts.out, force=opts.force, inputs={"folder": opts.folder})
    check_model_folder(Path(opts.folder))  # config values and sizes against the weights: a GGUF that matches them
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        with disk_errors(out):
            added = hf_to_gguf(opts.folder, tmp, outtype=opts.outtype)
            check_gguf_file(tmp)  # what llama.cpp's converter wrote agrees with its own tensors
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, out)
    except RuntimeError as e:
        raise UsageError(str(e).splitlines()[0] + (" " + str(e).splitlines()[-1] if "\n" in str(e) else "")) from None
    finally:
        tmp.unlink(missing_ok=True)
    print(f"saved {out} ({opts.outtype})" + (f"; post-step added {', '.join(added)}" if added else ""))
    return 0


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli(PROG, lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())

"""The options of a GGUF export (``kvsplice to-gguf``) as one typed object, whose fields declare the command line
(:mod:`kvsplice.io.options`): a DeepSeek-V3 folder and ``--out`` to convert (llama.cpp's converter,
:func:`kvsplice.convert.engines.gguf_convert.hf_to_gguf`), or ``--fix`` alone to add the key llama.cpp needs to a GGUF
converted by hand (:func:`kvsplice.convert.engines.gguf_convert.fix_gguf`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvsplice.io.options import opt
from kvsplice.io.run_options import ForceOption

__all__ = ["OUTTYPES", "ToGGUFOptions"]

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
"""The weights' types llama.cpp's converter writes (``--outtype``)."""


@dataclass(frozen=True, kw_only=True)
class ToGGUFOptions(ForceOption):
    """``folder`` → ``out`` at ``outtype``, or ``fix`` alone (the fields in ``--help`` order)."""

    folder: Optional[str] = opt(None, flags=("folder",), nargs="?", help="a to_mla --format deepseek_v3 folder")
    out: Optional[str] = opt(None, help="the GGUF file to write")
    outtype: str = opt("f32", choices=OUTTYPES, help="weights' type in the GGUF (default f32)")
    fix: Optional[str] = opt(None, metavar="GGUF", help="only add the missing key to a GGUF converted by hand")

    def __post_init__(self) -> None:
        """``outtype`` one llama.cpp's converter writes (a library call is checked as the command line is)."""
        if self.outtype not in OUTTYPES:
            raise ValueError(f"--outtype {self.outtype!r}: one of {', '.join(OUTTYPES)}")

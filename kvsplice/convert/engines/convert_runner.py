"""Run llama.cpp's ``convert_hf_to_gguf.py`` unchanged, telling it the pre-tokenizer of a tokenizer it cannot hash.

llama.cpp's converter names a BPE tokenizer's pre-tokenizer (``tokenizer.ggml.pre``) by hashing the token ids of a
fixed test string, so it knows only the vocabularies of published models: the BPE tokenizer a tiny config trains
(``data``'s offline tokenizer) is refused ("BPE pre-tokenizer was not recognized") although its pre-tokenizer is
GPT-2's own (``ByteLevel`` with GPT-2's split pattern). This runner, started as a script (``python
convert_runner.py LLAMA_CPP_ROOT CONVERTER_ARGS...``), answers ``gpt-2`` for exactly that case — a
``tokenizer.json`` whose whole pre-tokenizer is ``{"type": "ByteLevel", "use_regex": true}`` — and leaves every
other tokenizer to the converter's own check. It imports nothing from kvsplice (it runs in the converter's process).
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

GPT2 = "gpt-2"
"""llama.cpp's name of GPT-2's byte-level pre-tokenizer (its split regex), ``tokenizer.ggml.pre``."""


def is_gpt2_byte_level(tokenizer_json: Path) -> bool:
    """Whether a ``tokenizer.json``'s pre-tokenizer is exactly GPT-2's: one ``ByteLevel`` step with its regex."""
    if not tokenizer_json.is_file():
        return False
    pre = json.loads(tokenizer_json.read_text(encoding="utf-8")).get("pre_tokenizer") or {}
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True) is True


def main(argv: list[str]) -> None:
    root, args = Path(argv[0]), argv[1:]
    sys.path[:0] = [str(root), str(root / "gguf-py")]
    from conversion.base import TextModel  # llama.cpp's converter package

    known = TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            if is_gpt2_byte_level(Path(self.dir_model) / "tokenizer.json"):
                return GPT2
            raise

    TextModel.get_vocab_base_pre = vocab_base_pre
    sys.argv = [str(root / "convert_hf_to_gguf.py"), *args]
    runpy.run_path(str(root / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])

"""The model's tokenizer behind one small interface (:class:`Tokenizer`): from a transformers tokenizer, a
:class:`data.TextTokenizer` (GPT-2 BPE or the synthetic BPE), a tokenizer folder / file, or rebuilt from a training
checkpoint's data settings. Its :meth:`Tokenizer.document` adds the document separator the model was trained with."""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from kvsplice.io.cli import first_line
from kvsplice.loading.errors import LoadError

__all__ = ["Tokenizer", "checkpoint_tokenizer", "from_hf_tokenizer", "from_text_tokenizer", "load_tokenizer"]


@dataclass
class Tokenizer:
    """The model's tokenizer behind one small interface.

    ``encode(text)`` gives ids without special tokens; :meth:`document` adds the separator: ``bos_id`` before the
    story when ``sep == "bos"``, ``eos_id`` after it when ``sep == "eos"``.
    """

    encode: Callable[[str], list[int]]
    name: str
    vocab_size: int
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    sep: str = "none"  # "bos" | "eos" | "none"
    backend: Any = field(default=None, repr=False)

    def document(self, text: str) -> list[int]:
        ids = self.encode(text)
        if self.sep == "bos":
            return [self.bos_id] + ids
        if self.sep == "eos":
            return ids + [self.eos_id]
        return ids

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "vocab_size": self.vocab_size, "bos_id": self.bos_id, "eos_id": self.eos_id,
                "separator": self.sep}


def from_hf_tokenizer(tok: Any, name: str) -> Tokenizer:
    tok.model_max_length = int(1e30)  # we tokenise whole stories and cut windows ourselves: no length warning
    bos, eos = tok.bos_token_id, tok.eos_token_id
    try:
        probe = tok("a")["input_ids"]
        adds_bos = bos is not None and len(probe) > 0 and probe[0] == bos
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode "a" fails later with a clearer error
        adds_bos = False
    sep = "bos" if adds_bos else ("eos" if eos is not None else ("bos" if bos is not None else "none"))

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    return Tokenizer(encode, name, len(tok), bos, eos, sep, tok)


def from_text_tokenizer(tok: Any) -> Tokenizer:
    """A :class:`data.TextTokenizer` (GPT-2 BPE or the synthetic BPE): ``<|endoftext|>`` after every story."""
    return Tokenizer(tok.encode, tok.name, tok.vocab_size, None, tok.eot_id, "eos", tok)


def load_tokenizer(spec: str | os.PathLike) -> Tokenizer:
    """A tokenizer from a directory / file: an HF tokenizer directory (``tokenizer_config.json``), a GGUF file (or a
    folder holding one: the tokenizer :func:`load_model` gives with it, without the weights), or GPT-2 BPE files
    (``vocab.json``+``merges.txt``, ``encoder.json``+``vocab.bpe``) / a ``tokenizer.json`` via :mod:`data.tokenizer`."""
    from kvsplice.loading.gguf import find_gguf

    p = Path(spec).expanduser()
    if not p.exists():
        raise LoadError(f"tokenizer path not found: {spec}")
    hf = p.is_dir() and (p / "tokenizer_config.json").is_file()
    gguf = None if hf else find_gguf(p)
    if hf or gguf is not None:
        from transformers import AutoTokenizer

        try:
            tok = (AutoTokenizer.from_pretrained(str(p)) if hf else
                   AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name))
            return from_hf_tokenizer(tok, str(p))
        except Exception as e:  # noqa: BLE001
            raise LoadError(f"cannot load the tokenizer in {p}: {first_line(e)}") from None
    from data.errors import DataUnavailableError
    from data.tokenizer import load_bpe_tokenizer as load_bpe

    try:
        return from_text_tokenizer(load_bpe(p))
    except (DataUnavailableError, ValueError, OSError) as e:
        raise LoadError(f"cannot load a tokenizer from {spec}: {first_line(e)}") from None


def checkpoint_tokenizer(meta: dict, path: Path) -> Tokenizer:
    """The tokenizer a training checkpoint's data module used (its ``data_hparams``)."""
    from data import DataUnavailableError, TinyStoriesDataModule

    hp = dict(meta.get("data_hparams") or {})
    if not hp:
        raise LoadError(f"{path} stores no data settings to rebuild its tokenizer from; pass --tokenizer")
    allowed = set(inspect.signature(TinyStoriesDataModule.__init__).parameters) - {"self"}
    try:
        dm = TinyStoriesDataModule(**{k: v for k, v in hp.items() if k in allowed})
        return from_text_tokenizer(dm.tokenizer)
    except (DataUnavailableError, ValueError, OSError) as e:
        raise LoadError(f"cannot rebuild the tokenizer of {path} from its data settings ({first_line(e)}); "
                        f"pass --tokenizer") from None

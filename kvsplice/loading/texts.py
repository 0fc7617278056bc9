"""Calibration / evaluation text as stories, and stories as one token stream.

:func:`iter_texts`: a ``.txt`` file (stories separated by ``<|endoftext|>``, else by blank lines), ``.json``
(``{"texts": [...]}`` or a list), ``.jsonl``, or a folder of those — read with :mod:`data.sources` — or a Hugging
Face dataset id ``ID[:SPLIT]`` (``text`` column). :func:`token_stream` tokenises story by story with the model's
tokenizer and joins them with the tokenizer's document separator (BOS before each story for tokenizers that add
BOS, e.g. Llama / llama2.c; else EOS / ``<|endoftext|>`` after each story, e.g. GPT-2), stopping at ``max_tokens``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

from kvsplice.io.cli import first_line
from kvsplice.loading.errors import LoadError
from kvsplice.loading.tokenizers import Tokenizer

__all__ = ["iter_texts", "text_bytes", "text_tokens", "token_stream"]


def _is_local(spec: str) -> bool:
    """Whether ``spec`` names a local file / folder (else a Hugging Face dataset id)."""
    p = Path(spec).expanduser()
    return p.exists() or spec.startswith((".", "/", "~")) or p.suffix.lower() in (".txt", ".json", ".jsonl")


def _story_files(spec: str, option: str) -> list[Path]:
    from data.errors import DataUnavailableError
    from data.sources import list_story_files

    p = Path(spec).expanduser()
    if not p.exists():
        raise LoadError(f"--{option} {spec}: file not found")
    try:
        return list_story_files(p, option=option)  # checks each file: binary / empty text is refused here
    except DataUnavailableError as e:
        raise LoadError(first_line(e)) from None
    except OSError as e:  # a FIFO or another non-folder, non-file path
        raise LoadError(f"--{option} {spec}: cannot read it ({e.strerror or type(e).__name__})") from None


def text_bytes(spec: str | os.PathLike, *, option: str = "data") -> Optional[int]:
    """The bytes of the local text ``spec`` names (its files checked as :func:`iter_texts` reads them), or ``None``
    for a Hugging Face dataset id (size unknown until it is read)."""
    spec = str(spec)
    if not _is_local(spec):
        return None
    return sum(f.stat().st_size for f in _story_files(spec, option))


def text_tokens(option: str, value: Optional[int], default: int, spec: Optional[str | os.PathLike], *,
                text_option: str) -> int:
    """``value`` (``None``: not given, ``default``) checked as a token count of the text ``spec`` before any model
    is loaded (:func:`kvsplice.core.limits.check_text_tokens`); ``text_option`` names the text's option without
    dashes (``calib``). Without a text, a given count does nothing: refused."""
    from kvsplice.core.limits import check_text_tokens

    if spec is None:
        if value is not None:
            raise LoadError(f"{option} {value} needs --{text_option} TEXT (it does nothing without one)")
        return default
    return check_text_tokens(option, default if value is None else value, text_option=f"--{text_option} {spec}",
                             text_bytes=text_bytes(spec, option=text_option), given=value is not None)


def iter_texts(spec: str | os.PathLike, *, option: str = "data", split: str = "train") -> Iterator[str]:
    """Stories from a local file / folder (``.txt``/``.json``/``.jsonl``) or a Hugging Face dataset ``ID[:SPLIT]``.

    The source is checked before the first story is yielded (errors are raised by the first ``next()``)."""
    spec = str(spec)
    if _is_local(spec):
        from data.errors import DataUnavailableError
        from data.sources import iter_stories_from_file

        files = _story_files(spec, option)

        def gen() -> Iterator[str]:
            try:
                for f in files:
                    yield from iter_stories_from_file(f)
            except (DataUnavailableError, UnicodeDecodeError, ValueError) as e:
                raise LoadError(f"--{option} {spec}: {first_line(e)}") from None

        return gen()
    return _iter_hf_dataset(spec, option=option, split=split)


def _iter_hf_dataset(spec: str, *, option: str, split: str) -> Iterator[str]:
    name, _, sp = spec.partition(":")
    sp = sp or split
    try:
        import datasets
    except ImportError:
        raise LoadError(f"--{option} {spec}: not a local file, and the `datasets` package is not installed") from None
    from data.errors import hub_offline_reason

    reason = hub_offline_reason()
    if reason is not None and "OFFLINE=" not in reason:  # unreachable: fail now instead of retrying for ~30 s
        raise LoadError(f"--{option} {spec}: not a local file, and Hugging Face dataset {name!r} cannot be "
                        f"downloaded ({reason}); pass a local .txt/.json file")
    try:  # reachable, or offline mode (HF_*_OFFLINE=1): the local datasets cache may have it
        ds = datasets.load_dataset(name, split=sp, streaming=not reason)
    except Exception as e:  # noqa: BLE001
        why = reason if reason is not None else first_line(e, 200)
        raise LoadError(f"--{option} {spec}: not a local file, and Hugging Face dataset {name!r} (split {sp!r}) "
                        f"cannot be loaded ({why}); pass a local .txt/.json file") from None

    def gen() -> Iterator[str]:
        for row in ds:
            text = row.get("text") if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise LoadError(f"--{option} {spec}: rows have no 'text' column (got {sorted(row)[:5]})")
            if text.strip():
                yield text.strip()

    return gen()


def token_stream(texts: Iterable[str], tokenizer: Tokenizer, max_tokens: Optional[int] = None, *,
                 progress: bool = False, desc: str = "tokenize") -> tuple[torch.Tensor, int]:
    """Tokenise ``texts`` story by story (each with the tokenizer's separator) into one 1-D LongTensor, stopping
    once ``max_tokens`` tokens are collected (the tensor is cut to exactly ``max_tokens`` if that many exist).
    Returns ``(ids, n_stories)``."""
    from tqdm.auto import tqdm

    ids: list[int] = []
    n = 0
    with tqdm(total=max_tokens, desc=desc, unit="tok", disable=not progress, leave=False) as bar:
        for text in texts:
            doc = tokenizer.document(text)
            ids.extend(doc)
            n += 1
            bar.update(len(doc) if max_tokens is None else min(len(doc), max(max_tokens - bar.n, 0)))
            if max_tokens is not None and len(ids) >= max_tokens:
                break
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return torch.tensor(ids, dtype=torch.long), n

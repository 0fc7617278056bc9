"""What produced an ``eval_tasks`` output: fingerprints of the inputs that determine its answers.

A resumed ``--out`` may only be continued by a run whose answers would be the same for the instances it already
holds (:mod:`kvsplice.tasks.resume`). The answers are a function of the model (its fingerprint), the tokenizer (its
full serialisation), the stories text (its bytes), the door and the dtype, each instance's prompt (its token ids and
expected answers: :func:`instance_digest`, which also catches a change of the task generators) and each method
(its label and the bytes of every file its spec names — :func:`kvsplice.core.spec_files.spec_files` — by
:func:`method_files`). The device is not one of them: the
same dtype on another device is taken as the same computation.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional, Union

from kvsplice.tasks.instance import TaskInstance, prompt_ids

__all__ = ["DIGEST_CHARS", "file_digest", "instance_digest", "method_files", "text_digest",
           "tokenizer_fingerprint"]

DIGEST_CHARS = 16
"""Hex characters kept of a sha256 (64 bits: collisions are not a concern for a handful of files)."""
_CHUNK = 1 << 20


def text_digest(text: str) -> str:
    """A short sha256 of ``text`` (UTF-8)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:DIGEST_CHARS]


def file_digest(path: Union[str, Path]) -> str:
    """A short sha256 of a file's bytes (streamed)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()[:DIGEST_CHARS]


def tokenizer_fingerprint(tokenizer, *, loaded_from: Optional[str] = None) -> str:
    """A short sha256 of the tokenizer's full serialisation (vocabulary, merges, normaliser, ...) and of how the
    package uses it (BOS / EOS ids, separator): two tokenizers with the same fingerprint give the same ids, and the
    same tokenizer gives the same fingerprint wherever it is loaded from (``../m`` and ``/work/m``).
    ``loaded_from``: the earlier form, which also hashed the path it was loaded from (this one): a file recording it
    is resumed by the same tokenizer under any path (:func:`kvsplice.tasks.resume.resume`)."""
    backend = tokenizer.backend
    inner = getattr(backend, "backend_tokenizer", None)  # a transformers fast tokenizer
    if isinstance(getattr(backend, "fingerprint", None), str):  # data.TextTokenizer
        body: Any = backend.fingerprint
    elif inner is not None and hasattr(inner, "to_str"):
        body = inner.to_str()
    elif hasattr(backend, "get_vocab"):  # a slow tokenizer: its vocabulary and special tokens
        body = {"vocab": backend.get_vocab(), "special": getattr(backend, "all_special_tokens", None)}
    else:
        body = {"vocab_size": tokenizer.vocab_size, "name": tokenizer.name}
    use = {k: v for k, v in tokenizer.describe().items() if k != "name"}  # where it was loaded from: not what it does
    if loaded_from is not None:
        use["name"] = loaded_from
    return text_digest(json.dumps({"use": use, "body": body}, sort_keys=True, default=str))


def instance_digest(tokenizer, inst: TaskInstance) -> str:
    """A short sha256 of what an instance asks: its prompt's token ids (context and question), the expected answers
    and the tokens it may generate."""
    ctx, q = prompt_ids(tokenizer, inst)
    return text_digest(json.dumps([ctx, q, list(inst.answers), inst.max_new_tokens]))


def method_files(paths: list[Path]) -> dict[str, str]:
    """``{resolved path: digest}`` of the files a method reads (its spec or plan file and the files it names)."""
    return {str(p): file_digest(p) for p in paths if p.is_file()}

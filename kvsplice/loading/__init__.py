"""Shared loading of the commands: a model and its tokenizer, and calibration / evaluation text as one token stream.

* :mod:`~kvsplice.loading.models` — :func:`load_model` (HF folder or Hub id, GGUF, training ``.ckpt``, MLA folder);
* :mod:`~kvsplice.loading.tokenizers` — the :class:`Tokenizer` interface and :func:`load_tokenizer`;
* :mod:`~kvsplice.loading.texts` — :func:`iter_texts` (files, folders, HF datasets), :func:`token_stream` and the token-count check :func:`text_tokens`;
* :mod:`~kvsplice.loading.gguf`, :mod:`~kvsplice.loading.mla_folder` — the GGUF and converted-MLA formats.

Every failure is a :class:`LoadError` with a one-line message, for the CLIs to print.
"""

from __future__ import annotations

from kvsplice.io.cli import first_line
from kvsplice.loading.errors import LoadError
from kvsplice.loading.models import LoadedModel, load_model
from kvsplice.loading.texts import iter_texts, text_bytes, text_tokens, token_stream
from kvsplice.loading.tokenizers import Tokenizer, checkpoint_tokenizer, load_tokenizer

__all__ = ["LoadError", "LoadedModel", "Tokenizer", "checkpoint_tokenizer", "iter_texts", "load_model", "load_tokenizer",
           "text_bytes", "text_tokens", "token_stream", "first_line"]

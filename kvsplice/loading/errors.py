"""The one error of :mod:`kvsplice.loading`: a model, tokenizer or text that cannot be loaded, as one line."""

from __future__ import annotations


class LoadError(RuntimeError):
    """A model, tokenizer or text cannot be loaded; the message is one line."""

"""The data package's error type and the Hugging Face Hub reachability check."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

__all__ = ["OFFLINE_HINT", "BadTextError", "DataConfigError", "DataUnavailableError", "hub_offline_reason"]

#: How to train without any download; appended to "no data" errors.
OFFLINE_HINT = (
    "or train on the embedded offline synthetic stories with --data.synthetic true "
    "(configs tiny_gpt2.yaml, tiny_mla.yaml, tiny_mla_kvsplice_50/70/90.yaml)"
)

_TRUE = {"1", "true", "yes", "on"}


class DataUnavailableError(RuntimeError):
    """The requested data or tokenizer cannot be obtained (offline hub, missing local path, bad files).

    The message is always one line naming the config option to set (``data.path``, ``data.tokenizer_path``...), so a
    CLI can print it as is instead of a stack trace.

    Args:
        message: the one-line message.
        reason: the short underlying cause (e.g. ``"HF_HUB_OFFLINE=1"``), when there is one.
    """

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class BadTextError(DataUnavailableError):
    """A text file that cannot be training/calibration text: empty, or binary/garbage bytes (see
    :func:`data.sources.check_text_file`). A :class:`DataUnavailableError`, so existing handlers catch it."""


class DataConfigError(ValueError):
    """An invalid data setting (``data.batch_size 0``, ``data.block_size`` longer than the data, ...). The one-line
    message names the option; a ``ValueError`` as before, so callers catching that keep working."""


def hub_offline_reason(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face Hub cannot be used right now, or ``None`` if it looks reachable.

    Checked, fastest first: the offline environment variables (``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE``,
    ``TRANSFORMERS_OFFLINE``), then a TCP connection to the Hub endpoint (``HF_ENDPOINT``, default huggingface.co:443)
    with a ``timeout`` in seconds. The probe is skipped when an HTTP(S) proxy is configured (direct connections may be
    blocked while the proxy works); errors of the actual download are then reported by the caller.
    """
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            return f"{var}={os.environ[var]}"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = url.hostname or "huggingface.co"
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as e:
        return f"cannot reach {host}:{port}: {e.strerror or type(e).__name__}"

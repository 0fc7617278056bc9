"""kvsplice.loading.texts: the size of a text and the token counts asked of it, checked before a model loads."""

from __future__ import annotations

import os

import pytest

from kvsplice.loading import LoadError, text_bytes, text_tokens


def test_text_bytes_of_a_file_a_folder_and_a_hub_id(tmp_path):
    (tmp_path / "a.txt").write_text("Once upon a time.\n\nThe end.\n")
    (tmp_path / "b.txt").write_text("A cat sat.\n")
    assert text_bytes(tmp_path / "a.txt") == 28
    assert text_bytes(tmp_path) == 28 + 11
    assert text_bytes("roneneldan/TinyStories") is None  # a Hub dataset: unknown until read


def test_text_tokens_default_given_and_without_a_text(tmp_path):
    t = tmp_path / "a.txt"
    t.write_text("Once upon a time.\n\nThe end.\n")  # 28 bytes: at most 87 tokens
    assert text_tokens("--calib-tokens", None, 65536, str(t), text_option="calib") == 65536  # the default: whole text
    assert text_tokens("--calib-tokens", 87, 65536, str(t), text_option="calib") == 87
    with pytest.raises(ValueError, match="at most 87 tokens"):
        text_tokens("--calib-tokens", 88, 65536, str(t), text_option="calib")
    with pytest.raises(LoadError, match=r"--calib-tokens 100 needs --calib TEXT \(it does nothing without one\)"):
        text_tokens("--calib-tokens", 100, 65536, None, text_option="calib")
    assert text_tokens("--calib-tokens", None, 65536, None, text_option="calib") == 65536


def test_a_fifo_or_a_binary_file_is_refused_without_reading_a_model(tmp_path):
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    with pytest.raises(LoadError, match="--calib"):  # never blocks on the pipe
        text_tokens("--calib-tokens", 10, 100, str(fifo), text_option="calib")
    (tmp_path / "bin.txt").write_bytes(bytes(range(256)) * 40)
    with pytest.raises(LoadError, match="does not look like text"):
        text_tokens("--calib-tokens", None, 100, str(tmp_path / "bin.txt"), text_option="calib")

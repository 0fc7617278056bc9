"""Tokenizers for the data pipeline: the GPT-2 byte-level BPE (from local files or the Hugging Face Hub) and a small
byte-level BPE trained on the embedded synthetic stories.

Everything is wrapped in :class:`TextTokenizer`, a thin object with ``encode(str) -> list[int]``,
``decode(list[int]) -> str``, ``eot_id`` and ``vocab_size`` around a :class:`tokenizers.Tokenizer`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from data.errors import DataUnavailableError, hub_offline_reason

__all__ = [
    "EOT_TOKEN",
    "TextTokenizer",
    "find_gpt2_files",
    "load_gpt2_from_hub",
    "load_bpe_tokenizer",
    "train_bpe_tokenizer",
]

#: The end-of-text token put between stories (GPT-2's, id 50256 in GPT-2's vocabulary).
EOT_TOKEN = "<|endoftext|>"

# (vocab, merges) file-name pairs accepted for GPT-2-style BPE: HF names, then OpenAI's original names.
_GPT2_FILE_PAIRS = (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"))


class TextTokenizer:
    """A :class:`tokenizers.Tokenizer` with an end-of-text token and a content fingerprint.

    Args:
        tokenizer: the underlying byte-level BPE tokenizer; ``eot_token`` must be in its vocabulary.
        name: a short human-readable description (e.g. ``"gpt2"`` or ``"synthetic-bpe-2048"``).
        eot_token: the end-of-text token's string.
    """

    def __init__(self, tokenizer: Tokenizer, name: str, eot_token: str = EOT_TOKEN) -> None:
        eot_id = tokenizer.token_to_id(eot_token)
        if eot_id is None:
            raise ValueError(f"tokenizer {name!r} has no {eot_token!r} token")
        tokenizer.add_special_tokens([eot_token])  # keeps its id; makes it atomic and skippable in decode
        self._tok = tokenizer
        self.name = name
        self.eot_token = eot_token
        self.eot_id: int = int(eot_id)
        self._fingerprint: str | None = None

    @property
    def backend(self) -> Tokenizer:
        """The wrapped :class:`tokenizers.Tokenizer`."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of token ids (including special tokens)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def fingerprint(self) -> str:
        """A short sha256 of the tokenizer's full serialisation (vocabulary, merges, pre-tokenizer, ...)."""
        if self._fingerprint is None:
            self._fingerprint = hashlib.sha256(self._tok.to_str().encode("utf-8")).hexdigest()[:16]
        return self._fingerprint

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (parallel in Rust; no offsets computed)."""
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # tokenizers >= 0.21 has the fast one
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; the end-of-text token is kept as ``<|endoftext|>``."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the tokenizer as a ``tokenizer.json`` file (atomically)."""
        from models.checkpoint import atomic_write

        atomic_write(path, lambda tmp: tmp.write_text(self._tok.to_str(), encoding="utf-8"))

    def __repr__(self) -> str:
        return f"TextTokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"


def _byte_level(tok: Tokenizer) -> Tokenizer:
    """Configure GPT-2's byte-level pre-tokenizer (with its regex, no prefix space) and decoder."""
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def find_gpt2_files(path: str | os.PathLike[str]) -> tuple[Path, Path] | Path:
    """Locate tokenizer files at ``path``.

    Args:
        path: a directory holding ``vocab.json`` + ``merges.txt`` or ``encoder.json`` + ``vocab.bpe`` (or a
            ``tokenizer.json``), or one of those files (its sibling is looked up next to it).

    Returns:
        ``(vocab, merges)`` paths, or the path of a ``tokenizer.json``.

    Raises:
        DataUnavailableError: nothing usable at ``path``.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise DataUnavailableError(f"data.tokenizer_path={str(path)!r} does not exist (--data.tokenizer_path)")
    if p.is_file():
        if p.suffix == ".json" and p.name not in ("vocab.json", "encoder.json"):
            return p  # a tokenizers ``tokenizer.json``
        directory = p.parent
    else:
        directory = p
    for vocab, merges in _GPT2_FILE_PAIRS:
        if (directory / vocab).is_file() and (directory / merges).is_file():
            return directory / vocab, directory / merges
    if (directory / "tokenizer.json").is_file():
        return directory / "tokenizer.json"
    raise DataUnavailableError(
        f"data.tokenizer_path={str(path)!r} holds no tokenizer: expected vocab.json+merges.txt, "
        f"encoder.json+vocab.bpe or tokenizer.json (--data.tokenizer_path)"
    )


def load_bpe_tokenizer(path: str | os.PathLike[str]) -> TextTokenizer:
    """Load a byte-level BPE tokenizer from local files (see :func:`find_gpt2_files` for what ``path`` may be)."""
    found = find_gpt2_files(path)
    if isinstance(found, Path):
        return TextTokenizer(Tokenizer.from_file(str(found)), name=str(found))
    vocab, merges = found
    tok = _byte_level(Tokenizer(models.BPE.from_file(str(vocab), str(merges))))
    return TextTokenizer(tok, name=f"gpt2-bpe:{vocab.parent}")


def load_gpt2_from_hub(cache_dir: str | os.PathLike[str], repo_id: str = "gpt2") -> TextTokenizer:
    """GPT-2's tokenizer from the Hugging Face Hub, saved under ``cache_dir`` on first use (later calls are offline).

    Raises:
        DataUnavailableError: not cached and the Hub is unreachable (names ``data.tokenizer_path``).
    """
    cached = Path(cache_dir) / "tokenizers" / repo_id.replace("/", "__") / "tokenizer.json"
    if cached.is_file():
        return TextTokenizer(Tokenizer.from_file(str(cached)), name=repo_id)
    reason = hub_offline_reason()
    if reason is None:
        try:
            tok = TextTokenizer(Tokenizer.from_pretrained(repo_id), name=repo_id)
        except Exception as e:  # noqa: BLE001 - any hub/network failure becomes one clear error
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        else:
            tok.save(cached)
            return tok
    raise DataUnavailableError(
        f"the {repo_id!r} tokenizer cannot be downloaded ({reason}); point --data.tokenizer_path (data.tokenizer_path) "
        f"at a folder with GPT-2's vocab.json+merges.txt or encoder.json+vocab.bpe, or use --data.synthetic true "
        f"(configs tiny_gpt2.yaml, tiny_mla.yaml, tiny_mla_kvsplice_50/70/90.yaml)",
        reason=reason,
    ) from None


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 2048, min_frequency: int = 2) -> TextTokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style: byte alphabet, GPT-2 regex) on ``texts``.

    The result is deterministic for the same texts. ``<|endoftext|>`` is a special token with id 0.

    Args:
        texts: training texts (one story each).
        vocab_size: target vocabulary size including the 256 byte tokens and ``<|endoftext|>``.
        min_frequency: minimum pair count for a merge.
    """
    if vocab_size < 258:
        raise ValueError(f"vocab_size must be >= 258 (256 bytes + <|endoftext|> + 1 merge), got {vocab_size}")
    tok = _byte_level(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=False,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return TextTokenizer(tok, name=f"synthetic-bpe-{vocab_size}")

"""The llama2.c ``tokenizer.bin`` (pieces, scores) → a Hugging Face ``tokenizers`` BPE tokenizer with byte fallback
(SentencePiece BPE semantics: merges derived from the pieces ranked by score)."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

from kvsplice.convert.llama2c_format import SPIECE_UNDERLINE, Llama2cFormatError, read_bytes

__all__ = ["build_tokenizer", "read_llama2c_tokenizer"]


def read_llama2c_tokenizer(path: str | os.PathLike) -> tuple[list[bytes], list[float], int]:
    """Read a llama2.c ``tokenizer.bin``: returns ``(pieces as raw bytes, scores, max_token_length)``.

    The vocabulary size is not stored in the file; it is the number of records up to the end of the file.
    """
    path = Path(path)
    buf = read_bytes(path)
    if len(buf) < 4:
        raise Llama2cFormatError(f"{path}: file too short for a llama2.c tokenizer ({len(buf)} bytes)")
    (max_len,) = struct.unpack_from("<i", buf, 0)
    if not 0 < max_len <= 4096:
        raise Llama2cFormatError(f"{path}: bad max_token_length {max_len} in llama2.c tokenizer header")
    pieces, scores, off = [], [], 4
    while off < len(buf):
        if off + 8 > len(buf):
            raise Llama2cFormatError(f"{path}: truncated tokenizer record {len(pieces)} at byte {off}")
        score, n = struct.unpack_from("<fi", buf, off)
        off += 8
        if n < 0 or n > max_len or off + n > len(buf):
            raise Llama2cFormatError(
                f"{path}: corrupt/truncated tokenizer record {len(pieces)} at byte {off - 8} "
                f"(length {n}, max_token_length {max_len}, {len(buf) - off} bytes left)"
            )
        pieces.append(buf[off:off + n])
        scores.append(float(score))
        off += n
    if len(pieces) < 3:
        raise Llama2cFormatError(f"{path}: tokenizer has only {len(pieces)} tokens")
    return pieces, scores, max_len


def _hf_piece(raw: bytes, idx: int, path: Any = "tokenizer") -> str:
    if idx == 1 and raw.strip() == b"<s>":
        return "<s>"
    if idx == 2 and raw.strip() == b"</s>":
        return "</s>"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Llama2cFormatError(f"{path}: token {idx} {raw!r} is not valid UTF-8 ({e})") from None
    return text.replace(" ", SPIECE_UNDERLINE)


def build_tokenizer(pieces: list[bytes], scores: list[float], model_max_length: int | None = None, path: Any = "tokenizer"):
    """Build a ``PreTrainedTokenizerFast`` equivalent to llama2.c's (SentencePiece-style) BPE tokenizer.

    * vocab: pieces with " " -> "▁"; ids 0/1/2 become ``<unk>``/``<s>``/``</s>`` (special tokens);
    * merges: every split ``(a, b)`` of a multi-character piece ``a + b`` with both halves in the vocab,
      ranked by the merged piece's score (highest first) -- SentencePiece BPE merges the best-scoring adjacent
      pair, which is what llama2.c ``run.c`` ``encode`` does;
    * normalizer: prepend one "▁" (run.c's dummy prefix), spaces -> "▁"; no pre-tokenizer (run.c encodes the
      whole text as one sequence). Text after a special token written inside the string (e.g. "a</s>b") gets its
      own dummy prefix, as the legacy HF Llama tokenizer did;
    * byte fallback to ``<0xNN>`` for characters outside the vocab; BOS is prepended on encode;
    * decoder: "▁" -> " ", byte fallback, fuse, strip one leading space.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    strs = [_hf_piece(p, i, path) for i, p in enumerate(pieces)]
    vocab: dict[str, int] = {}
    for i, s in enumerate(strs):
        if s in vocab:
            raise Llama2cFormatError(f"{path}: duplicate token {s!r} at ids {vocab[s]} and {i}")
        vocab[s] = i
    if strs[0] != "<unk>":
        raise Llama2cFormatError(f"{path}: expected token 0 to be <unk>, got {strs[0]!r}")
    specials = {0, 1, 2}
    byte_pieces = {f"<0x{b:02X}>" for b in range(256)}
    missing_bytes = byte_pieces - vocab.keys()
    if missing_bytes:
        raise Llama2cFormatError(f"{path}: {len(missing_bytes)} byte-fallback pieces <0xNN> missing from the vocab")

    merges: list[tuple[float, int, int, int, tuple[str, str]]] = []
    for i, s in enumerate(strs):
        if i in specials or s in byte_pieces or len(s) < 2:
            continue
        for k in range(1, len(s)):
            a, b = s[:k], s[k:]
            ia, ib = vocab.get(a), vocab.get(b)
            if ia is None or ib is None or ia in specials or ib in specials:
                continue
            merges.append((-scores[i], i, ia, ib, (a, b)))
    merges.sort()

    tok = Tokenizer(BPE(vocab=vocab, merges=[m[-1] for m in merges], unk_token="<unk>", fuse_unk=True,
                        byte_fallback=True, dropout=None))
    # run.c / SentencePiece: always prepend one dummy "▁" (even before a leading space), spaces -> "▁", and run
    # BPE over the whole text (no whitespace pre-split). A Metaspace pre-tokenizer would skip the dummy prefix
    # when the text already starts with a space, which breaks parity with run.c and the decode round trip.
    tok.normalizer = normalizers.Sequence([
        normalizers.Prepend(SPIECE_UNDERLINE),
        normalizers.Replace(" ", SPIECE_UNDERLINE),
    ])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([
        decoders.Replace(SPIECE_UNDERLINE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
        decoders.Strip(content=" ", left=1, right=0),
    ])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    # BOS before every text in the tokenizer itself: transformers 4.x's PreTrainedTokenizerFast ignores add_bos_token
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", vocab["<s>"])])
    kwargs = {}
    if model_max_length:
        kwargs["model_max_length"] = int(model_max_length)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        padding_side="left",
        **kwargs,
    )

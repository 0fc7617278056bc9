"""The package's own door: :class:`Decoder` runs any model the adapters support with any
:class:`~kvsplice.core.method.CompressionMethod` (dense K/V, the model's own MLA/KVSplice cache, low-rank
coefficients, online FD chunks, token subsets, stacks of them) — the same methods the HF door
(:mod:`kvsplice.hf`) runs inside ``transformers.generate()``."""

from kvsplice.core.method import CompressionMethod, Step
from kvsplice.decode.decoder import Decoder, perplexity, score_continuation, sequence_nll
from kvsplice.decode.dense import DenseKV
from kvsplice.decode.native import ModelAttention

__all__ = ["CompressionMethod", "Decoder", "DenseKV", "ModelAttention", "Step", "perplexity",
           "score_continuation", "sequence_nll"]

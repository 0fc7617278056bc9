"""One decoder, one method interface: :class:`Decoder` runs any model the adapters support with any
:class:`CompressionMethod` (dense K/V, the model's own MLA/KVSplice cache, low-rank coefficients, online FD chunks,
token subsets)."""

from kvsplice.decode.decoder import Decoder, perplexity, sequence_nll
from kvsplice.decode.dense import DenseKV
from kvsplice.decode.method import CompressionMethod, Step
from kvsplice.decode.native import ModelAttention

__all__ = ["CompressionMethod", "Decoder", "DenseKV", "ModelAttention", "Step", "perplexity", "sequence_nll"]

"""The method core every compression method and both doors share: the method interface (``method``:
:class:`CompressionMethod`, :class:`Step`), attention over held keys/values (``attention``), RoPE tables for
pre-RoPE storage (``rope``), and the §3.5 error bounds and diagnostics of approximate attention (``bounds``,
``diagnostics``). Nothing here imports a method package."""

from kvsplice.core.attention import dense_attend, keys_seen, masked_attend, reference_attention, weighted_attend
from kvsplice.core.method import CompressionMethod, Step
from kvsplice.core.rope import RopeTables

__all__ = ["CompressionMethod", "RopeTables", "Step", "dense_attend", "keys_seen", "masked_attend",
           "reference_attention", "weighted_attend"]

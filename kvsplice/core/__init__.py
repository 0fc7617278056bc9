"""The method core every compression method and both doors share: the method interface (``method``:
:class:`CompressionMethod`, :class:`Step`), attention over held keys/values (``attention``), RoPE tables for
pre-RoPE storage (``rope``), sliding-window layers (``window``), and the attention-error bounds and diagnostics of
approximate attention (``bounds``, ``diagnostics``). Nothing here imports a method package."""

from kvsplice.core.attention import dense_attend, keys_seen, masked_attend, reference_attention, weighted_attend
from kvsplice.core.method import CompressionMethod, Step
from kvsplice.core.rope import RopeTables, rope_tables
from kvsplice.core.window import evict, window_mask

__all__ = ["CompressionMethod", "RopeTables", "Step", "dense_attend", "evict", "keys_seen", "masked_attend",
           "reference_attention", "rope_tables", "weighted_attend", "window_mask"]

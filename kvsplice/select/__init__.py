"""Token selection: BalanceKV (``balance``), the selectors behind one interface (``selectors``, ``knorm``), the
token-subset cache (``cache``), the ``TokenSelection`` compression method (``method``) and the BalanceKV paper's
single-layer experiment (``experiment``)."""

from kvsplice.select.cache import SubsetCache, TokenSelectionResult
from kvsplice.select.knorm import KnormSelector  # importing it registers the "knorm" selector for make_selector
from kvsplice.select.scores import ObservedAttentionSelector, SnapKVSelector  # "snapkv", "observed_attention"
from kvsplice.select.method import TokenSelection, TokenSelectionDecoder, run_token_selection
from kvsplice.select.kvzip import KVzipSelection
from kvsplice.select.expected import ExpectedAttentionSelector  # "expected_attention"
from kvsplice.select.selectors import (SELECTORS, BalanceKVSelector, StreamingLLMSelector, TokenSelector,
                                       UniformSelector, make_selector)

__all__ = ["BalanceKVSelector", "ExpectedAttentionSelector", "KVzipSelection", "KnormSelector", "ObservedAttentionSelector", "SELECTORS", "SnapKVSelector", "StreamingLLMSelector", "SubsetCache", "TokenSelection",
           "TokenSelectionDecoder", "TokenSelectionResult", "TokenSelector", "UniformSelector", "make_selector",
           "run_token_selection"]

"""Token selection: BalanceKV (``balance``), the selectors behind one interface (``selectors``, ``knorm``), the
token-subset cache (``cache``), the ``TokenSelection`` decode method (``method``) and the BalanceKV paper's
single-layer experiment (``experiment``)."""

from kvsplice.select import knorm  # noqa: E402,F401  (registers the "knorm" selector for make_selector)

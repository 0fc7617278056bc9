"""Token selection: BalanceKV (``balance``), the selectors behind one interface (``selectors``, ``knorm``), the
token-subset cache (``cache``), the ``TokenSelection`` decode method (``method``) and the BalanceKV paper's
single-layer experiment (``experiment``)."""

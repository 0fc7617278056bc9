"""Online frequent-directions bases: the FD sketch (``fd``), blockwise softmax (``blockwise``), the chunked cache
(``chunked``) and attention over it (``attention``), error bounds (``bounds``) and diagnostics (``diagnostics``),
and the ``OnlineFD`` decode method (``method``)."""

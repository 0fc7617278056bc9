"""Post-training low-rank bases: calibration Grams (``calibrate``), fits (``fits``), the bases container
(``bases``), the coefficient cache (``cache``) and the ``LowRank`` decode method (``method``, ``fold``)."""

"""What every benchmark script shares, built once: the study runner (:mod:`~benchmarks.harness.runner`: argv, sizes,
outputs, resume, header, timers, atomic writing), sections in their own processes under a time budget, rows as
tables by section and the ``pytest -m gpu`` run with its log (``sections``), the parser and shared
options (``options``), the result header (``header``), median timers (``timing``), the shared data's paths
(``paths``) and each study's YAML settings (``studies``)."""

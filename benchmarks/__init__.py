"""The benchmarks: one script per study (``python -m benchmarks.<study>``, from the repository root), each a
:class:`~benchmarks.harness.runner.Study` on one runner (:mod:`benchmarks.harness`: options, sizes, outputs, the
result header, timers, atomic writing), the study helpers in :mod:`benchmarks.lib` and each study's settings in
``benchmarks/studies/*.yaml``. Not part of the installed package."""

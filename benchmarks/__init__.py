"""The benchmarks: one script per study (``python -m benchmarks.<study>``), each a ``Study`` on one runner
(:mod:`benchmarks.harness`), helpers in :mod:`benchmarks.lib`, settings in ``benchmarks/studies/*.yaml``. Not part of
the installed package."""

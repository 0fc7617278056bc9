"""The benchmarks: one script per study (``python benchmarks/<study>.py`` or ``python -m benchmarks.<study>``), built
on one harness (:mod:`benchmarks.harness`: options, the result header, timers, the results writer, the shared-data
paths), the study helpers in :mod:`benchmarks.lib` and each study's settings in ``benchmarks/studies/*.yaml``. Not
part of the installed package: run from the repository root."""

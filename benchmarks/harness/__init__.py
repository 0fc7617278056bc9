"""What every benchmark script shares, built once:

* :mod:`~benchmarks.harness.options` — the parser (one-line errors, exit 2) and the shared options (``--threads``,
  ``--out`` / ``--json`` / ``--force``, ``--model``, ``--device`` / ``--dtype``, ``--no-progress``), and
  :func:`~benchmarks.harness.options.command`, the ``main`` wrapper (one ``PROG: error:`` line, Ctrl-C exit 130);
* :mod:`~benchmarks.harness.header` — the command / machine / revision header every result records;
* :mod:`~benchmarks.harness.timing` — median timers: thread-CPU time and CUDA events;
* :mod:`~benchmarks.harness.results` — ``results/<study>[_<tag>].{json,md,png}``;
* :mod:`~benchmarks.harness.paths` — the shared reference data (``../shared/data``), resolved once;
* :mod:`~benchmarks.harness.studies` — a study's settings from ``benchmarks/studies/<study>.yaml``.
"""

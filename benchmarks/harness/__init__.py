"""What every benchmark script shares, built once:

* :mod:`~benchmarks.harness.runner` — the study runner: a study is settings plus a function that yields rows; the
  runner owns argv, sizes and their bounds, the outputs (refused unless ``--force``), resume, the header, timers and
  atomic JSON / Markdown / PNG writing;
* :mod:`~benchmarks.harness.sections` — a study's sections each in its own process under a time budget
  (``gpu_check``), and the markdown tables of rows by section; :mod:`~benchmarks.harness.testlog` — the pytest
  plugin logging each test as it ends, and ``pytest -m gpu`` run with it;
* :mod:`~benchmarks.harness.options` — the parser (one-line errors, exit 2) and the shared options (``--threads``,
  ``--out``, ``--model``, ``--device`` / ``--dtype``, ``--no-progress``), and
  :func:`~benchmarks.harness.options.command`, the ``main`` wrapper (one ``PROG: error:`` line, Ctrl-C exit 130);
* :mod:`~benchmarks.harness.header` — the command / machine / revision header every result records;
* :mod:`~benchmarks.harness.timing` — median timers: thread-CPU time and CUDA events;
* :mod:`~benchmarks.harness.paths` — the shared reference data (``../shared/data``), resolved once;
* :mod:`~benchmarks.harness.studies` — a study's settings from ``benchmarks/studies/<study>.yaml``.
"""

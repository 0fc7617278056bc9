"""What every benchmark script shares: the study runner (``runner``), its report from YAML (``report``), sections in
their own processes and the ``pytest -m gpu`` run with its log (``sections``), options, the result header, timers,
the shared data's paths and each study's YAML settings (``studies``)."""

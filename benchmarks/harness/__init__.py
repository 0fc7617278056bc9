"""What every benchmark script shares: the study runner (``runner``), its report from YAML (``report``), sections in
their own processes (``sections``), the pytest logs (``testlog``), options, the result header, timers, the shared
data's paths and each study's YAML settings (``studies``)."""

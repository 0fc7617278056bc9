"""``python -m kvsplice.bench_balance``: the command ``kvsplice bench-balance`` (:mod:`kvsplice.cli.bench_balance`), kept so existing scripts run."""

from kvsplice.cli.main import shim

main = shim(__name__, "bench-balance")

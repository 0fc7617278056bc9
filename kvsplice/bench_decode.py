"""``python -m kvsplice.bench_decode``: the command ``kvsplice bench-decode`` (:mod:`kvsplice.cli.bench_decode`), kept so existing scripts run."""

from kvsplice.cli.main import shim

main = shim(__name__, "bench-decode")

"""``python -m kvsplice.verify_memory``: the command ``kvsplice verify-memory`` (:mod:`kvsplice.cli.verify_memory`), kept so existing scripts run."""

from kvsplice.cli.main import shim

main = shim(__name__, "verify-memory")

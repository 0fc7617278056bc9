"""``python -m kvsplice.generate``: the command ``kvsplice generate`` (:mod:`kvsplice.cli.generate`), kept so existing scripts run."""

from kvsplice.cli.main import shim

main = shim(__name__, "generate")

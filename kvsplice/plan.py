"""``python -m kvsplice.plan``: the command ``kvsplice plan`` (:mod:`kvsplice.cli.plan`), kept so existing scripts run."""

from kvsplice.cli.main import shim

main = shim(__name__, "plan")

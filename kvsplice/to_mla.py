"""``python -m kvsplice.to_mla``: the command ``kvsplice to-mla`` (:mod:`kvsplice.cli.to_mla`), kept so existing scripts run."""

from kvsplice.cli.main import shim

main = shim(__name__, "to-mla")

"""``python -m kvsplice.fit_bases``: the command ``kvsplice fit-bases`` (:mod:`kvsplice.cli.fit_bases`), kept so existing scripts run."""

from kvsplice.cli.main import shim

main = shim(__name__, "fit-bases")

"""``python -m kvsplice.eval_bases``: the command ``kvsplice eval-bases`` (:mod:`kvsplice.cli.eval_bases`), kept so existing scripts run."""

from kvsplice.cli.main import shim

main = shim(__name__, "eval-bases")

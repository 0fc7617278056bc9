"""``python -m kvsplice.eval_tasks``: the command ``kvsplice eval-tasks`` (:mod:`kvsplice.cli.eval_tasks`), kept so existing scripts run."""

from kvsplice.cli.main import shim

main = shim(__name__, "eval-tasks")

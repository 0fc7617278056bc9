"""``python -m kvsplice.to_gguf``: the command ``kvsplice to-gguf`` (:mod:`kvsplice.cli.to_gguf`), kept so existing scripts run."""

from kvsplice.cli.main import shim

main = shim(__name__, "to-gguf")

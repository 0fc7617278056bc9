"""``python -m kvsplice.convert_llama2c``: the command ``kvsplice convert-llama2c`` (:mod:`kvsplice.cli.convert_llama2c`), kept so existing scripts run."""

from kvsplice.cli.main import shim

main = shim(__name__, "convert-llama2c")

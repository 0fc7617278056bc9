"""The commands: one module per verb of the ``kvsplice`` console command (:mod:`kvsplice.cli.main`), each a thin
layer of options over the library. Importing this package is light (no torch)."""

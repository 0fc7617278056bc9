"""Serving engines the package's exports run in (optional dependencies): :mod:`kvsplice.convert.engines.llama_cpp`,
:mod:`kvsplice.convert.engines.vllm`."""

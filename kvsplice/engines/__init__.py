"""Serving engines the package's exports run in (optional dependencies): :mod:`kvsplice.engines.llama_cpp`,
:mod:`kvsplice.engines.vllm`."""

"""Self-contained transformers remote-code files that ``kvsplice export`` copies into an exported model
directory (``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``). They import only ``torch`` and
``transformers``: nothing from this package, so the directory works without it."""

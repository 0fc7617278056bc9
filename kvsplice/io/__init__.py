"""Input and output of the tools: model / tokenizer / text loading (``loading``) and shared CLI helpers (``cli``)."""

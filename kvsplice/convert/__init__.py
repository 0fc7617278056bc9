"""Conversion and export: models in, other layouts and file formats out, and the engines that run them.

| what a user does | command | modules |
|---|---|---|
| trained MHA / GQA GPT → MLA, KVSplice inserted | ``kvsplice to-mla --model X.ckpt`` | :mod:`~kvsplice.convert.mla`, :mod:`~kvsplice.convert.kvsplice_keep` |
| Llama / Mistral / Qwen2 / Qwen3 → decoupled-RoPE MLA folder | ``kvsplice to-mla --model DIR`` | :mod:`~kvsplice.convert.llama_run`, :mod:`~kvsplice.convert.llama_mla` |
| any MLA model → DeepSeek-V3 folder (transformers, vLLM, SGLang) | ``to-mla --format deepseek_v3``, ``export --format deepseek_v3`` | :mod:`~kvsplice.convert.deepseek_v3` (the one exporter) with a writer per source family: :mod:`~kvsplice.convert.deepseek_v3_llama`, :mod:`~kvsplice.convert.deepseek_v3_gpt`; shared assembly :mod:`~kvsplice.convert.deepseek_v3_writer`, exact cache-row padding :mod:`~kvsplice.convert.latent_pad` |
| trained deepseek_v3-layout MHA → Llama folder | ``kvsplice export --format llama`` | :mod:`~kvsplice.convert.gpt_deepseek` |
| llama2.c checkpoint → HF Llama folder | ``kvsplice convert-llama2c`` | :mod:`~kvsplice.convert.llama2c` (+ ``_format``, ``_tokenizer``) |
| DeepSeek-V3 folder → GGUF; run a GGUF | ``kvsplice to-gguf`` | :mod:`~kvsplice.convert.engines.gguf_convert`; :mod:`~kvsplice.convert.engines.llama_cpp` |
| serve in vLLM | ``benchmarks`` | :mod:`~kvsplice.convert.engines.vllm` |

The commands live in :mod:`kvsplice.cli` (``to_mla``, ``to_gguf``, ``convert_llama2c``) and :mod:`training.export`
(GPT-2 / remote-code / DeepSeek-V3 / Llama folders of a training checkpoint); the folders they read back are
:mod:`kvsplice.loading` (``mla_folder``, ``gguf``). Every command checks its outputs before any work and writes them
whole or not at all (:mod:`kvsplice.io.folders`). Words: *ratio* is times smaller everywhere; a kept fraction of the
latent is *keep* (``--kvsplice-keep 0.1`` keeps 10 %: KVSplice-90).
"""

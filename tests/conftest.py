"""Shared test setup."""

import signal
import sys
from pathlib import Path

import pytest
import torch


# The test folders mirror the package; a few test modules reuse another's helpers by module name
# (``from test_kvzip import ...``) and the helpers beside this file (``hostile``, ``tiny_models``): every test folder
# is importable. Appended, so nothing in a test folder shadows an installed module.
for _folder in sorted(p for p in Path(__file__).parent.rglob("*") if p.is_dir() and p.name != "__pycache__"):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))


# A test run started in the background of a non-interactive shell inherits SIGINT ignored, and passes that on to
# every process it starts; the Ctrl-C tests need Python's own handling here and in their child processes (a handled
# signal is reset to its default across exec, an ignored one is not).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """The tests run many small ops on tiny tensors: intra-op threads only add contention on a 2-core machine
    (measured: up to 40× slower when the cores are shared). Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One synthetic-data cache for every training test module (the BPE tokenizer is trained once)."""
    d = tmp_path_factory.getbasetemp() / "robust_data_cache"
    d.mkdir(exist_ok=True)
    return d


@pytest.fixture
def offline(monkeypatch):
    """No hub access and W&B disabled for the test."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")


# Triton's interpreter runs the decode kernels (models.kernels) on CPU tensors; it must be on before triton is
# imported, i.e. before any test module is: here. Without CUDA nothing else in the suite compiles Triton code.
if not torch.cuda.is_available():
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")

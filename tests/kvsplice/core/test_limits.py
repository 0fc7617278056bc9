"""The shared size check: counts, numbers, threads and the memory estimate, each a one-line error naming the option."""

import math

import pytest

from kvsplice.core import limits
from models.config import GPTConfig


def test_available_bytes_reads_this_machine():
    assert limits.available_bytes() > 1 << 20 and limits.available_bytes("cpu") > 1 << 20
    assert 1 <= limits.cpu_count()


@pytest.mark.parametrize("value, ok", [(1, True), (0, False), (10**9 + 10**9, False), (True, False), (2.0, False)])
def test_check_count(value, ok):
    if ok:
        assert limits.check_count("--batch", value) == value
    else:
        with pytest.raises(ValueError, match=r"^--batch must be"):
            limits.check_count("--batch", value, 1, 10**9)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1.0, 0.0, "3"])
def test_check_number_refuses_nan_inf_and_out_of_range(value):
    with pytest.raises(ValueError, match=r"^--budget-gb must be"):
        limits.check_number("--budget-gb", value)
    assert limits.check_number("--max-seconds", 0.0, 0.0, lo_open=False) == 0.0


def test_check_threads_within_the_cpus():
    assert limits.check_threads("--threads", None) is None
    assert limits.check_threads("--threads", limits.cpu_count()) == limits.cpu_count()
    with pytest.raises(ValueError, match=r"^--threads must be <= \d+ \(the CPUs this process may use\), got 100000$"):
        limits.check_threads("--threads", 100000)


def test_check_fits_and_the_gpt_estimate():
    cfg = GPTConfig(vocab_size=100, n_layer=2, n_head=2, d_model=16, block_size=10**9)
    need = limits.gpt_run_bytes(cfg, tokens=8, batch=1, elt=4, cache_bytes=0, logits_tokens=8)
    assert need > 10**9 * 16 * 4  # the learned positions alone
    limits.check_fits("--seq-lens 8", 1000, "the run", available=1001)
    with pytest.raises(ValueError, match=r"^--seq-lens 1000000000: the run needs about 64.0 GB, more than the "
                                         r"1.0 GB this machine has free$"):
        limits.check_fits("--seq-lens 1000000000", need, "the run", available=10**9)
    with pytest.raises(ValueError, match="needs about"):
        limits.check_fits("--x", math.inf, "the run")


def test_check_training_fits_names_both_options():
    cfg = GPTConfig(vocab_size=100, n_layer=2, n_head=2, d_model=16, block_size=64)
    limits.check_training_fits(cfg, 4)
    with pytest.raises(ValueError, match=r"^--model.block_size 64 with --data.batch_size 1000000000: training "):
        limits.check_training_fits(cfg, 10**9)
    with pytest.raises(ValueError, match=r"^--data.batch_size must be >= 1, got 0$"):
        limits.check_training_fits(cfg, 0)


def test_check_text_tokens_bounds_by_the_maximum_and_by_the_text():
    assert limits.check_text_tokens("--calib-tokens", 300, text_option="--calib t", text_bytes=100) == 300
    with pytest.raises(ValueError, match=r"--calib-tokens 304: --calib t holds 100 B of text, at most 303 tokens"):
        limits.check_text_tokens("--calib-tokens", 304, text_option="--calib t", text_bytes=100)
    assert limits.check_text_tokens("--calib-tokens", 304, text_option="--calib t", text_bytes=100, given=False) == 304
    assert limits.check_text_tokens("--tokens", 10**6, text_option="--data hub/id", text_bytes=None) == 10**6
    with pytest.raises(ValueError, match=r"--tokens must be <= 16777216 \(the most text tokens a run holds\)"):
        limits.check_text_tokens("--tokens", limits.MAX_TEXT_TOKENS + 1, text_option="--data x", text_bytes=None,
                                 given=False)

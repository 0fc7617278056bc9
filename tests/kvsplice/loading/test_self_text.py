"""``kvsplice.loading.self_text``: stories260K (a transformers Llama) writes its own text from the built-in prompts; the corpus
is cached, read back without generating, extended as a continuation, keyed by the sampling settings; a model that
cannot generate is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvsplice.loading.self_prompts import PROMPTS, UNCONDITIONAL, prompt_list
from kvsplice.loading.self_text import SelfTextError, SelfTextOptions, cache_key, default_cache_dir, self_text

DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
STORIES = DATA / "stories260K"


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    if not (STORIES / "stories260K.bin").is_file():
        pytest.skip(f"stories260K not found under {DATA}")
    from kvsplice.convert.llama2c import convert_llama2c
    from kvsplice.loading import load_model

    src = convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp_path_factory.mktemp("st") / "src")
    return load_model(src)


OPTS = SelfTextOptions(tokens=700, sample_len=96, batch_size=4)


def test_generates_once_then_reads_the_cache_and_extends_it_as_a_continuation(stories, tmp_path):
    m = stories
    first = self_text(m.model, m.tokenizer, OPTS, cache_dir=tmp_path, progress=False)
    assert first.generated >= 700 and first.ids.shape == (700,) and first.path.parent == tmp_path
    again = self_text(m.model, m.tokenizer, OPTS, cache_dir=tmp_path, progress=False)
    assert again.generated == 0 and torch.equal(again.ids, first.ids)  # the second call generates nothing
    shorter = self_text(m.model, m.tokenizer, SelfTextOptions(tokens=300, sample_len=96, batch_size=4),
                        cache_dir=tmp_path, progress=False)
    assert shorter.generated == 0 and torch.equal(shorter.ids, first.ids[:300]) and shorter.path == first.path
    longer = self_text(m.model, m.tokenizer, SelfTextOptions(tokens=1500, sample_len=96, batch_size=4),
                       cache_dir=tmp_path, progress=False)
    assert 0 < longer.generated and longer.ids.shape == (1500,) and torch.equal(longer.ids[:700], first.ids)
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]  # one file, no temporary left


def test_documents_start_with_the_prompts_and_sampling_settings_change_the_key(stories, tmp_path):
    m = stories
    tok = m.tokenizer
    got = self_text(m.model, tok, OPTS, cache_dir=tmp_path, progress=False).ids.tolist()
    prompts = prompt_list(OPTS.unconditional)
    assert tok.sep == "bos" and got[0] == tok.bos_id
    starts = [i for i, t in enumerate(got) if t == tok.bos_id]  # one document per sample
    assert len(starts) >= 5
    for k, i in enumerate(starts[:4]):
        head = tok.encode(prompts[k])
        assert got[i + 1:i + 1 + len(head)] == head  # the batch's prompts in order
    assert all(b - a <= OPTS.sample_len for a, b in zip(starts, starts[1:]))  # samples end within their length
    other = SelfTextOptions(tokens=700, sample_len=96, batch_size=4, seed=1)
    assert cache_key(m.model, tok, other) != cache_key(m.model, tok, OPTS)
    assert cache_key(m.model, tok, SelfTextOptions(tokens=9, sample_len=96, batch_size=4)) == cache_key(m.model, tok,
                                                                                                         OPTS)
    assert self_text(m.model, tok, other, cache_dir=tmp_path, progress=False).ids.tolist() != got


def test_a_model_that_cannot_generate_is_refused(stories, tmp_path):
    with pytest.raises(SelfTextError, match="cannot generate"):
        self_text(torch.nn.Linear(2, 2), stories.tokenizer, OPTS, cache_dir=tmp_path, progress=False)
    assert not any(tmp_path.iterdir())


def test_the_prompts_span_domains_and_the_cache_folder_follows_xdg(monkeypatch, tmp_path):
    prompts = prompt_list(3)
    assert len(PROMPTS) >= 10 and len(prompts) >= 200 + 3
    assert prompts[-3:] == [UNCONDITIONAL] * 3 and len(set(prompts[:-3])) == len(prompts) - 3
    assert {prompts[i] for i in range(len(PROMPTS))} == {g[0] for g in PROMPTS.values()}  # interleaved by domain
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "kvsplice" / "self_text"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "kvsplice" / "self_text"

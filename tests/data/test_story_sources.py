"""The story sources under the DataModule (``data.story_sources``) and its tokenizer routes (``data.tokenizer_routes``):
the DataModule picks its source by precedence, each source keys the shard cache by what it reads and writes the
stories it has, the Hub source fails fast offline, and a trained tokenizer is cached by what it was trained on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from data import DataUnavailableError, TinyStoriesDataModule, generate_stories, train_bpe_tokenizer
from data.shards import SHARD_DTYPE
from data.story_sources import HubStories, LocalStories, SyntheticStories
from data.tokenizer_routes import check_cache_dir, pick_tokenizer


def _write(path: Path, stories: list[str]) -> Path:
    path.write_text("\n<|endoftext|>\n".join(stories), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer(generate_stories(60, seed=5), vocab_size=300)


def test_the_datamodule_picks_its_source_by_precedence(tmp_path):
    _write(tmp_path / "a.txt", generate_stories(5, seed=1))
    assert isinstance(TinyStoriesDataModule(synthetic=True).stories, SyntheticStories)
    local = TinyStoriesDataModule(path=str(tmp_path), val_fraction=0.2).stories
    assert isinstance(local, LocalStories) and local.path == str(tmp_path) and local.val_fraction == 0.2
    hub = TinyStoriesDataModule(dataset="someone/Stories").stories
    assert isinstance(hub, HubStories) and hub.dataset == "someone/Stories"
    assert [TinyStoriesDataModule(**kw).source for kw in ({"synthetic": True}, {"path": str(tmp_path)}, {})] == \
        ["synthetic", "local", "hub"]


def test_a_local_folder_splits_by_file_name_and_keys_the_cache_by_its_files(tmp_path, tok):
    train = _write(tmp_path / "stories.txt", generate_stories(30, seed=1))
    val = _write(tmp_path / "stories_val.txt", generate_stories(6, seed=2))
    src = LocalStories(str(tmp_path), None, 0.1)
    assert src.files() == ([train], [val])
    prefix, spec = src.shard_spec()
    assert prefix == f"local-{tmp_path.name}"[:46] and [f["path"] for f in spec["validation"]] == [str(val)]
    assert "val_fraction" not in spec  # a validation file: nothing is held out
    out = tmp_path / "out"
    out.mkdir()
    stats = src.write(out, tok)
    assert stats["train"]["stories"] == 30 and stats["validation"]["stories"] == 6
    ids = np.fromfile(out / "val.bin", dtype=SHARD_DTYPE)
    assert (ids == tok.eot_id).sum() == 6  # one <|endoftext|> after each validation story
    assert src.empty("validation") == f"data.path={str(tmp_path)!r}"
    assert LocalStories(str(tmp_path), str(val), 0.1).empty("validation") == f"data.val_path={str(val)!r}"


def test_a_source_without_validation_files_holds_out_a_tail(tmp_path, tok):
    _write(tmp_path / "only_val.txt", generate_stories(40, seed=3))  # only validation-looking names: all train
    src = LocalStories(str(tmp_path), None, 0.25)
    train, val = src.files()
    assert len(train) == 1 and val == [] and src.shard_spec()[1]["val_fraction"] == 0.25
    out = tmp_path / "out"
    out.mkdir()
    stats = src.write(out, tok)
    assert stats["validation"]["stories"] > 0 and stats["train"]["stories"] + stats["validation"]["stories"] == 40


def test_the_synthetic_source_writes_its_stories_and_names_its_seed(tmp_path, tok):
    src = SyntheticStories(stories=20, seed=7, val_fraction=0.1)
    prefix, spec = src.shard_spec()
    assert prefix == "synthetic-s7-n20" and spec["val_stories"] == src.val_count == 2
    stats = src.write(tmp_path, tok)
    assert stats["train"]["stories"] == 20 and stats["validation"]["stories"] == 2
    assert SyntheticStories(20, 8, 0.1).shard_spec() != (prefix, spec)


def test_the_hub_source_fails_fast_offline_naming_the_dataset(monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setattr("data.story_sources.hub_offline_reason", lambda: "no network (test)")
    with pytest.raises(DataUnavailableError, match=r"'someone/Stories'.*no network \(test\).*--data\.path"):
        HubStories("someone/Stories", 0.05).load()


def test_tokenizer_routes_a_given_file_first_and_caches_a_trained_one(tmp_path, tok):
    file = tmp_path / "tokenizer.json"
    tok.save(file)
    synthetic = SyntheticStories(stories=50, seed=3, val_fraction=0.1)
    given = pick_tokenizer(synthetic, tokenizer_path=str(file), synthetic_vocab_size=280, bpe_vocab_size=None,
                           cache_dir=tmp_path / "c")
    assert given.fingerprint == tok.fingerprint
    first = pick_tokenizer(synthetic, tokenizer_path=None, synthetic_vocab_size=280, bpe_vocab_size=None,
                           cache_dir=tmp_path / "c")
    cached = list((tmp_path / "c" / "tokenizers").glob("synthetic-bpe280-*.json"))
    assert first.name == "synthetic-bpe-280" and first.vocab_size == 280 and len(cached) == 1
    again = pick_tokenizer(synthetic, tokenizer_path=None, synthetic_vocab_size=280, bpe_vocab_size=None,
                           cache_dir=tmp_path / "c")
    assert again.fingerprint == first.fingerprint and list((tmp_path / "c" / "tokenizers").iterdir()) == cached
    local = LocalStories(str(_write(tmp_path / "s.txt", generate_stories(30, seed=4))), None, 0.1)
    bpe = pick_tokenizer(local, tokenizer_path=None, synthetic_vocab_size=280, bpe_vocab_size=290,
                         cache_dir=tmp_path / "c")
    assert bpe.name == "local-bpe-290" and bpe.vocab_size == 290


def test_a_cache_dir_that_is_a_file_is_one_clear_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(DataUnavailableError, match="data.cache_dir=.* cannot be created"):
        check_cache_dir(tmp_path / "f" / "sub")

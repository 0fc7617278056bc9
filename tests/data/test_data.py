"""Tests of the data package: synthetic stories, tokenizers, token shards, block datasets, local TinyStories files,
the Hub path (with an in-memory stand-in for ``datasets.load_dataset``) and the offline errors."""

from __future__ import annotations

import json
import math
import re
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from data import (
    DataUnavailableError,
    TinyStoriesDataModule,
    generate_stories,
    load_bpe_tokenizer,
    train_bpe_tokenizer,
    unigram_entropy,
)
from data import stories as story_gen
from data.sampler import EpochSampler
from data.sources import is_validation_file, iter_stories_from_file, list_story_files

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
TINY = SHARED / "tinystories"
GPT2 = SHARED / "gpt2_tokenizer"
EOT_TXT = TINY / "gusjengis_toy-RNN__tinystories_sample.txt"
VAL_TXT = TINY / "yuninxia_moe-routing-bench__tinystories_val.txt"
JSON_FILE = TINY / "maxme1_tiny-stories__tiny-stories.json"
needs_shared = pytest.mark.skipif(
    not (TINY.is_dir() and GPT2.is_dir()),
    reason=f"real TinyStories samples / GPT-2 tokenizer files not found at {SHARED} (../shared/data)",
)

BLOCK = 64
SMALL = dict(
    synthetic=True,
    synthetic_stories=3000,
    block_size=BLOCK,
    batch_size=4,
    train_batches_per_epoch=5,
    val_batches=3,
    seed=7,
)


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may open a network connection."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> TinyStoriesDataModule:
    """A small prepared synthetic datamodule (3000 stories)."""
    dm = TinyStoriesDataModule(cache_dir=str(tmp_path_factory.mktemp("cache")), **SMALL)
    dm.prepare_data()
    dm.setup("fit")
    return dm


# ----------------------------------------------------------------------------------------------------------------------
# Synthetic stories
# ----------------------------------------------------------------------------------------------------------------------


def test_synthetic_stories_deterministic_and_varied() -> None:
    a = generate_stories(600, seed=3)
    assert a == generate_stories(600, seed=3)
    assert a != generate_stories(600, seed=4)
    val = generate_stories(600, seed=3, split="validation")
    assert not set(val) & set(a), "validation stories must come from a different stream"
    assert len(set(a)) >= 595

    names = story_gen.GIRL_NAMES + story_gen.BOY_NAMES + story_gen.PET_NAMES
    heroes = set()
    for s in a:
        hero = next(n for n in re.findall(r"[A-Z][a-z]+", s) if n in names)
        heroes.add(hero)
        assert s.count(hero) >= 3, "the hero's name is reused through the story"
        assert '"' in s, "every story has dialogue"
        assert s.rstrip()[-1] in '.!"'
    assert len(heroes) >= 30
    places = {p for p, *_ in story_gen.PLACES if any(f"the {p}" in s for s in a)}
    assert len(places) >= 10
    # pronoun consistency: a girl hero is never "he" in the opening paragraph and vice versa
    for s in a:
        first = s.split("\n")[0]
        if " girl " in first:
            assert not re.search(r"\b[Hh]e\b", first)
        if " boy " in first:
            assert not re.search(r"\b[Ss]he\b", first)


def test_synthetic_tokenizer_roundtrip_and_deterministic() -> None:
    texts = generate_stories(800, seed=11)
    tok = train_bpe_tokenizer(texts, vocab_size=1024)
    tok2 = train_bpe_tokenizer(texts, vocab_size=1024)
    assert tok.fingerprint == tok2.fingerprint
    assert 300 < tok.vocab_size <= 1024
    assert tok.decode([tok.eot_id]) == "<|endoftext|>"
    for text in texts[:50] + ['Héllo wörld 😀 — "quotes"\n\nnew paragraph  two  spaces']:
        ids = tok.encode(text)
        assert tok.eot_id not in ids
        assert tok.decode(ids) == text
    # BPE compresses the stories well below one token per character
    assert sum(len(tok.encode(t)) for t in texts[:50]) < 0.35 * sum(len(t) for t in texts[:50])


# ----------------------------------------------------------------------------------------------------------------------
# Shards and blocks
# ----------------------------------------------------------------------------------------------------------------------


def test_synthetic_shards_uint16_and_idempotent(synth: TinyStoriesDataModule) -> None:
    folder = synth.shard_dir
    assert folder is not None and folder.parent == Path(synth.cache_dir)
    train = folder / "train.bin"
    val = folder / "val.bin"
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["dtype"] == "uint16"
    tokens = np.memmap(train, dtype=np.uint16, mode="r")
    assert len(tokens) == meta["splits"]["train"]["tokens"] > 100_000
    assert int(tokens.max()) < synth.vocab_size
    # one end-of-text token after every story
    assert int((tokens == synth.eot_id).sum()) == meta["splits"]["train"]["stories"] == SMALL["synthetic_stories"]
    assert tokens[-1] == synth.eot_id
    first = synth.tokenizer.decode(tokens[: int(np.argmax(tokens == synth.eot_id))].tolist())
    assert first == generate_stories(1, seed=SMALL["seed"])[0]

    stamps = {p: p.stat().st_mtime_ns for p in (train, val, folder / "meta.json")}
    synth.prepare_data()  # same instance
    again = TinyStoriesDataModule(cache_dir=str(synth.cache_dir), **SMALL)  # fresh instance, cached tokenizer
    again.prepare_data()
    assert again.shard_dir == folder
    assert again.tokenizer.fingerprint == synth.tokenizer.fingerprint
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps, "second prepare must not rewrite the shards"
    assert len([p for p in Path(synth.cache_dir).iterdir() if p.name.startswith("synthetic")]) == 1

    # another seed -> another cache entry
    other = TinyStoriesDataModule(cache_dir=str(synth.cache_dir), **{**SMALL, "seed": 8, "synthetic_stories": 500})
    other.prepare_data()
    assert other.shard_dir != folder


def test_unigram_entropy(synth: TinyStoriesDataModule) -> None:
    assert unigram_entropy(np.array([3, 3, 3], dtype=np.uint16), 5) == 0.0
    assert unigram_entropy(np.array([0, 1, 2, 3], dtype=np.uint16), 4) == pytest.approx(math.log(4))
    tokens = np.memmap(synth.shard_dir / "train.bin", dtype=np.uint16, mode="r")
    counts = np.bincount(tokens, minlength=synth.vocab_size)
    p = counts[counts > 0] / counts.sum()
    assert synth.unigram_entropy == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-9)
    assert 3.0 < synth.unigram_entropy < math.log(synth.vocab_size)


def test_blocks_shapes_and_shift(synth: TinyStoriesDataModule) -> None:
    tokens = np.memmap(synth.shard_dir / "train.bin", dtype=np.uint16, mode="r")
    ds = synth.train_set
    assert ds is not None and len(ds) == SMALL["train_batches_per_epoch"] * SMALL["batch_size"]
    for draw in (0, 1, 12345):
        x, y = ds[draw]
        assert x.shape == y.shape == (BLOCK,) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[1:], y[:-1])
        o = ds.offset(draw)
        assert torch.equal(x, torch.from_numpy(tokens[o : o + BLOCK].astype(np.int64)))
        assert torch.equal(y, torch.from_numpy(tokens[o + 1 : o + BLOCK + 1].astype(np.int64)))
        assert torch.equal(ds[draw][0], x), "a draw is deterministic"
    offsets = {ds.offset(d) for d in range(200)}
    assert len(offsets) > 190 and max(offsets) <= len(tokens) - BLOCK - 1

    x, y = next(iter(synth.train_dataloader()))
    assert x.shape == y.shape == (SMALL["batch_size"], BLOCK) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])

    # validation: fixed, evenly spaced blocks, identical across instances
    vx = torch.cat([b[0] for b in synth.val_dataloader()])
    assert vx.shape == (SMALL["val_batches"] * SMALL["batch_size"], BLOCK)
    other = TinyStoriesDataModule(cache_dir=str(synth.cache_dir), **SMALL)
    other.setup("validate")
    assert torch.equal(vx, torch.cat([b[0] for b in other.val_dataloader()]))
    offs = synth.val_set.offsets
    assert offs[0] == 0 and offs[-1] == synth.val_set.shard.max_offset and np.all(np.diff(offs) > 0)


def test_epoch_sampler_fresh_blocks_and_ddp_sharding(synth: TinyStoriesDataModule) -> None:
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    n = 10
    sampler = EpochSampler(n)
    e0 = list(sampler)
    sampler.set_epoch(1)
    e1 = list(sampler)
    assert e0 == list(range(n)) and e1 == list(range(n, 2 * n))
    ds = synth.train_set
    assert {ds.offset(d) for d in e0} != {ds.offset(d) for d in e1}

    # Lightning's DDP wrapper forwards set_epoch and splits the epoch's draws between ranks
    shards = []
    for rank in range(2):
        w = DistributedSamplerWrapper(EpochSampler(n), num_replicas=2, rank=rank, shuffle=False)
        w.set_epoch(3)
        shards.append(list(w))
    assert sorted(shards[0] + shards[1]) == list(range(3 * n, 4 * n))


def test_lightning_fit_uses_fresh_train_blocks_each_epoch(tmp_path: Path, synth: TinyStoriesDataModule) -> None:
    import lightning as L

    class Probe(L.LightningModule):
        def __init__(self, vocab_size: int) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(vocab_size, 8)
            self.head = torch.nn.Linear(8, vocab_size)
            self.seen: dict[int, list[torch.Tensor]] = {}
            self.val_seen: dict[int, list[torch.Tensor]] = {}

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
            x, y = batch
            self.seen.setdefault(self.current_epoch, []).append(x.clone())
            return torch.nn.functional.cross_entropy(self.head(self.emb(x)).flatten(0, 1), y.flatten())

        def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
            self.val_seen.setdefault(self.current_epoch, []).append(batch[0].clone())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = TinyStoriesDataModule(cache_dir=str(synth.cache_dir), **SMALL)
    model = Probe(dm.vocab_size)
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model, datamodule=dm)
    assert len(model.seen[0]) == len(model.seen[1]) == SMALL["train_batches_per_epoch"]
    assert not torch.equal(torch.cat(model.seen[0]), torch.cat(model.seen[1])), "each epoch draws new blocks"
    assert torch.equal(torch.cat(model.val_seen[0]), torch.cat(model.val_seen[1])), "validation blocks are fixed"


def test_cli_signature() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(TinyStoriesDataModule, "data")
    cfg = parser.parse_args(["--data.synthetic", "true", "--data.block_size", "128", "--data.path", "null"])
    assert cfg.data.synthetic is True and cfg.data.block_size == 128 and cfg.data.seed == 1337
    dm = TinyStoriesDataModule(**cfg.data)
    assert dm.source == "synthetic" and dm.cache_dir == Path(".cache/data")
    with pytest.raises(ValueError, match="mutually exclusive"):
        TinyStoriesDataModule(synthetic=True, path="x.txt")


# ----------------------------------------------------------------------------------------------------------------------
# Local files (synthetic content, all formats)
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, expect", [
    ('{"text": "cut off', "line 5 is not valid JSON (Unterminated string starting at column 10)"),
    ("42", "line 5 holds a JSON int, expected a string or a {\"text\": ...} object"),
    ('{"title": "no text"}', "line 5 holds a JSON dict"),
])
def test_a_bad_jsonl_line_is_named_by_its_line_number(tmp_path: Path, bad: str, expect: str) -> None:
    """``json.loads`` of one line said "line 1" whatever the line (and a story that is not one was named without
    its line): the error names the file's own line, blank lines counted."""
    lines = [json.dumps({"text": f"Story number {i}."}) for i in range(3)]
    f = tmp_path / "s.jsonl"
    f.write_text("\n".join([*lines[:2], "", "  ", bad, lines[2]]) + "\n")
    with pytest.raises(DataUnavailableError) as err:
        list(iter_stories_from_file(f))
    assert str(err.value).startswith(f"{f}: {expect}"), str(err.value)
    f.write_text("\n".join([*lines[:2], "", lines[2]]) + "\n")  # blank lines are skipped
    assert list(iter_stories_from_file(f)) == ["Story number 0.", "Story number 1.", "Story number 2."]


def test_local_formats_and_splits(tmp_path: Path, synth: TinyStoriesDataModule) -> None:
    stories = generate_stories(40, seed=5)
    with_blank = "First paragraph of a story.\n\nSecond paragraph after a blank line."
    (tmp_path / "eot.txt").write_text("\n<|endoftext|>\n".join(stories[:10] + [with_blank]) + "\n<|endoftext|>\n")
    (tmp_path / "blank.txt").write_text("\r\n\r\n".join(s.replace("\n", "\r\n") for s in stories[10:20]) + "\r\n")
    (tmp_path / "list.json").write_text(json.dumps(stories[20:25]))
    (tmp_path / "objs.json").write_text(json.dumps([{"text": s} for s in stories[25:30]]))
    (tmp_path / "texts.json").write_text(json.dumps({"texts": stories[30:35]}))
    (tmp_path / "lines.jsonl").write_text("\n".join(json.dumps({"text": s}) for s in stories[35:40]) + "\n")

    assert list(iter_stories_from_file(tmp_path / "eot.txt")) == stories[:10] + [with_blank]
    assert list(iter_stories_from_file(tmp_path / "blank.txt")) == stories[10:20]
    assert list(iter_stories_from_file(tmp_path / "list.json")) == stories[20:25]
    assert list(iter_stories_from_file(tmp_path / "objs.json")) == stories[25:30]
    assert list(iter_stories_from_file(tmp_path / "texts.json")) == stories[30:35]
    assert list(iter_stories_from_file(tmp_path / "lines.jsonl")) == stories[35:40]
    assert len(list_story_files(tmp_path)) == 6

    assert is_validation_file(Path("tinystories_val.txt")) and is_validation_file(Path("TinyStories-valid.txt"))
    assert is_validation_file(Path("validation.json")) and not is_validation_file(Path("interval_stories.txt"))

    # a saved tokenizer.json works as tokenizer_path; a folder with a *_val file uses it as the validation split
    tok_file = tmp_path / "tok" / "tokenizer.json"
    synth.tokenizer.save(tok_file)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.txt").write_text("\n<|endoftext|>\n".join(generate_stories(300, seed=1)))
    (corpus / "stories_val.txt").write_text("\n\n".join(generate_stories(30, seed=2)))
    dm = TinyStoriesDataModule(
        path=str(corpus),
        tokenizer_path=str(tok_file),
        cache_dir=str(tmp_path / "c"),
        block_size=BLOCK,
        batch_size=2,
        val_batches=2,
    )
    dm.setup()
    assert dm.tokenizer.fingerprint == synth.tokenizer.fingerprint
    assert dm.meta["splits"]["train"]["stories"] == 300 and dm.meta["splits"]["validation"]["stories"] == 30

    # a single file: the last val_fraction of its stories is held out, cut at a story boundary
    single = TinyStoriesDataModule(
        path=str(corpus / "train.txt"),
        tokenizer_path=str(tok_file),
        cache_dir=str(tmp_path / "c"),
        block_size=BLOCK,
        val_fraction=0.1,
    )
    single.setup()
    sp = single.meta["splits"]
    assert sp["train"]["stories"] + sp["validation"]["stories"] == 300 and 20 <= sp["validation"]["stories"] <= 40
    val = np.memmap(single.shard_dir / "val.bin", dtype=np.uint16, mode="r")
    assert single.tokenizer.decode(val[:200].tolist()).startswith(generate_stories(300, seed=1)[sp["train"]["stories"]])


# ----------------------------------------------------------------------------------------------------------------------
# Real TinyStories samples + GPT-2 tokenizer files (../shared/data)
# ----------------------------------------------------------------------------------------------------------------------


@needs_shared
def test_gpt2_tokenizer_files() -> None:
    tok = load_bpe_tokenizer(GPT2)
    assert tok.vocab_size == 50257 and tok.eot_id == 50256
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode("<|endoftext|>") == [50256]
    assert load_bpe_tokenizer(GPT2 / "vocab.bpe").fingerprint == tok.fingerprint  # a file inside the folder works too


@needs_shared
@pytest.mark.parametrize(
    ("file", "min_stories"),
    [(EOT_TXT, 2000), (VAL_TXT, 4000), (JSON_FILE, 3000)],
    ids=["endoftext-txt", "blank-line-val-txt", "texts-json"],
)
def test_real_tinystories_files(tmp_path: Path, file: Path, min_stories: int) -> None:
    stories = list(iter_stories_from_file(file))
    assert len(stories) >= min_stories
    assert not any("<|endoftext|>" in s for s in stories)
    if file == JSON_FILE:
        assert len(stories) == 3000
    if file == VAL_TXT:
        assert not any("\n\n" in s for s in stories)
        assert stories[0].startswith("Spot. Spot saw the shiny car")

    dm = TinyStoriesDataModule(
        path=str(file), tokenizer_path=str(GPT2), cache_dir=str(tmp_path), block_size=128, batch_size=2, val_batches=2
    )
    dm.setup()
    assert dm.vocab_size == 50257
    train = np.memmap(dm.shard_dir / "train.bin", dtype=np.uint16, mode="r")
    assert train.dtype == np.uint16 and int(train.max()) <= 50256
    n_train = dm.meta["splits"]["train"]["stories"]
    assert int((train == 50256).sum()) == n_train and n_train + dm.meta["splits"]["validation"]["stories"] == len(
        stories
    )
    text = dm.tokenizer.decode(train[:40].tolist())
    assert len(text) > 100 and stories[0].startswith(text)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 128) and torch.equal(x[:, 1:], y[:, :-1])
    assert 4.0 < dm.unigram_entropy < 8.0


@needs_shared
def test_real_tinystories_folder_uses_val_file(tmp_path: Path) -> None:
    folder = tmp_path / "tinystories"  # links to two of the shared files (a train and a validation file)
    folder.mkdir()
    for f in (EOT_TXT, VAL_TXT):
        (folder / f.name).symlink_to(f)
    dm = TinyStoriesDataModule(
        path=str(folder), tokenizer_path=str(GPT2), cache_dir=str(tmp_path), block_size=256, batch_size=2, val_batches=2
    )
    dm.setup()
    val = np.memmap(dm.shard_dir / "val.bin", dtype=np.uint16, mode="r")
    assert dm.tokenizer.decode(val[:12].tolist()).startswith("Spot. Spot saw the shiny car")
    assert dm.meta["splits"]["validation"]["stories"] == len(list(iter_stories_from_file(VAL_TXT)))
    assert dm.meta["splits"]["train"]["stories"] == len(list(iter_stories_from_file(EOT_TXT)))
    assert "local" in dm.describe()


# ----------------------------------------------------------------------------------------------------------------------
# Hub path (no network) and errors
# ----------------------------------------------------------------------------------------------------------------------


def test_hub_path_with_in_memory_dataset(
    tmp_path: Path, synth: TinyStoriesDataModule, monkeypatch: pytest.MonkeyPatch
) -> None:
    datasets = pytest.importorskip("datasets")
    train, val = generate_stories(200, seed=21), generate_stories(20, seed=22)
    fake = datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": train}), "validation": datasets.Dataset.from_dict({"text": val})}
    )
    calls: list[str] = []
    monkeypatch.setattr(datasets, "load_dataset", lambda name, *a, **k: calls.append(name) or fake)
    monkeypatch.setattr("data.story_sources.hub_offline_reason", lambda: None)
    tok_file = tmp_path / "tokenizer.json"
    synth.tokenizer.save(tok_file)
    dm = TinyStoriesDataModule(
        dataset="someone/Stories",
        tokenizer_path=str(tok_file),
        cache_dir=str(tmp_path),
        block_size=BLOCK,
        batch_size=2,
        val_batches=2,
    )
    dm.prepare_data()
    assert calls == ["someone/Stories"] and dm.shard_dir.name.startswith("hub-someone_Stories")
    assert dm.meta["splits"]["train"]["stories"] == 200 and dm.meta["splits"]["validation"]["stories"] == 20
    TinyStoriesDataModule(
        dataset="someone/Stories", tokenizer_path=str(tok_file), cache_dir=str(tmp_path)
    ).prepare_data()
    assert calls == ["someone/Stories"], "cached shards are reused without loading the dataset again"


@pytest.mark.parametrize("env", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_offline_without_data_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: str) -> None:
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)  # CI itself runs offline: test one variable at a time
    monkeypatch.setenv(env, "1")
    dm = TinyStoriesDataModule(cache_dir=str(tmp_path))
    for action in (dm.prepare_data, lambda: dm.vocab_size, lambda: dm.setup("fit")):
        with pytest.raises(DataUnavailableError) as info:
            action()
        msg = str(info.value)
        assert "\n" not in msg and f"{env}=1" in msg
        assert "--data.path" in msg and "--data.synthetic true" in msg
        assert "tiny_gpt2.yaml" in msg and "tiny_mla.yaml" in msg and "tiny_mla_kvsplice_50/70/90.yaml" in msg
        assert info.value.__cause__ is None and info.value.__suppress_context__
    assert isinstance(info.value, RuntimeError)

    # local stories but no tokenizer files: the error names data.tokenizer_path
    (tmp_path / "s.txt").write_text("\n\n".join(generate_stories(5)))
    with pytest.raises(DataUnavailableError, match=r"--data\.tokenizer_path"):
        TinyStoriesDataModule(path=str(tmp_path / "s.txt"), cache_dir=str(tmp_path)).prepare_data()


def test_missing_paths_are_clear_errors(tmp_path: Path, synth: TinyStoriesDataModule) -> None:
    missing = tmp_path / "nope" / "stories.txt"
    with pytest.raises(DataUnavailableError, match=r"data\.path=.*does not exist"):
        TinyStoriesDataModule(path=str(missing), cache_dir=str(tmp_path)).prepare_data()
    with pytest.raises(DataUnavailableError, match=r"data\.tokenizer_path=.*does not exist"):
        _ = TinyStoriesDataModule(synthetic=True, tokenizer_path=str(missing), cache_dir=str(tmp_path)).vocab_size
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataUnavailableError, match=r"without \.txt/\.json/\.jsonl"):
        TinyStoriesDataModule(path=str(tmp_path / "empty"), cache_dir=str(tmp_path)).prepare_data()
    with pytest.raises(DataUnavailableError, match="holds no tokenizer"):
        _ = TinyStoriesDataModule(
            synthetic=True, tokenizer_path=str(tmp_path / "empty"), cache_dir=str(tmp_path)
        ).vocab_size
    # block_size larger than a tiny validation shard
    big = TinyStoriesDataModule(cache_dir=str(synth.cache_dir), **{**SMALL, "block_size": 100_000})
    with pytest.raises(ValueError, match="block_size"):
        big.setup()

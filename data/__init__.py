"""Data for the kvsplice language models: TinyStories (Hub or local files) or embedded synthetic stories.

Main entry point: :class:`TinyStoriesDataModule`. Offline default: ``TinyStoriesDataModule(synthetic=True)``.
"""

from data.datamodule import TinyStoriesDataModule
from data.errors import BadTextError, DataConfigError, DataUnavailableError
from data.shards import unigram_entropy
from data.sources import check_text_file
from data.stories import generate_stories, iter_stories
from data.tokenizer import EOT_TOKEN, TextTokenizer, load_bpe_tokenizer, train_bpe_tokenizer

__all__ = [
    "EOT_TOKEN",
    "BadTextError",
    "DataConfigError",
    "DataUnavailableError",
    "TextTokenizer",
    "TinyStoriesDataModule",
    "check_text_file",
    "generate_stories",
    "iter_stories",
    "load_bpe_tokenizer",
    "train_bpe_tokenizer",
    "unigram_entropy",
]

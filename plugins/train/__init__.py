"""Training small gpt_bigcode code models on the Python standard library (stdlib split by whole file)."""

from plugins.train.cache import ensure_trained
from plugins.train.loop import train
from plugins.train.perplexity import perplexity

__all__ = ["ensure_trained", "perplexity", "train"]

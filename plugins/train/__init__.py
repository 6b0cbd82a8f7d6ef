"""Training small gpt_bigcode code models on the Python standard library (stdlib split by whole file)."""

from .cache import ensure_trained
from .loop import train
from .perplexity import perplexity

__all__ = ["ensure_trained", "perplexity", "train"]

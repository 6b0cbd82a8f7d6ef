"""The converters' one error type (a ValueError through ConfigError)."""

from plugins.core.config import ConfigError


class ConversionError(ConfigError):
    """A checkpoint cannot be converted: missing/extra/misshapen tensors, disagreeing ranks, bad TP."""

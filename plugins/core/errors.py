"""The one error of a bad config or setting (re-exported by plugins.core.config, where callers import it)."""


class ConfigError(ValueError):
    """A config file or a requested setting is invalid."""

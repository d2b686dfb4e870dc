"""Errors a user can act on. The CLI prints them as one line and exits with code 2."""


class PocketdiffError(Exception):
    """Bad input: a config, a path, a dataset, a checkpoint. Message names the culprit."""


class ConfigError(PocketdiffError):
    """A config file or override is wrong (unknown key, wrong type, invalid value)."""


class ParityError(PocketdiffError):
    """A conversion or compression fell below its named parity threshold."""


def require(condition: bool, key: str, message: str) -> None:
    """Raise ConfigError naming `key` when `condition` is false (used in __post_init__)."""
    if not condition:
        raise ConfigError(f"{key}: {message}")

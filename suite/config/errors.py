"""The one exception type that reaches users as a single line with exit code 2."""


class ConfigError(ValueError):
    """A user-facing input error: the message names the key, the value and what would work."""

    exit_code = 2

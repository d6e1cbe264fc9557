"""The one exception hierarchy users can catch: ``KvrouteError`` and its kinds."""

from __future__ import annotations


class KvrouteError(Exception):
    """Base of every error kvroute raises on purpose."""


class ConfigError(KvrouteError, ValueError):
    """Bad configuration; ``key`` names the offending setting (dotted path)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


class InputError(KvrouteError, ValueError):
    """Bad user input file; ``where`` names the line or field."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where
        self.message = message

"""The exception tree. Only configuration problems ever reach a user's job; every other
error stops at the tier boundary and becomes a counted miss."""

from __future__ import annotations


class WarmstartError(Exception):
    """Base of every error warmstart raises."""


class ConfigError(WarmstartError, ValueError):
    """A setting is malformed. The message is one line: variable, value, what is accepted."""

    def __init__(self, variable: str, value: object, accepted: str) -> None:
        self.variable, self.value, self.accepted = variable, value, accepted
        super().__init__(f"{variable}={value!r} is not valid: expected {accepted}")


class IntegrityError(WarmstartError):
    """A cached entry failed its signature or checksum and was not handed to torch."""

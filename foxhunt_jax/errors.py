"""User-facing errors.

Every mistake a user can make (a bad file, a bad config value, a bad CLI argument) raises a
subclass of :class:`FoxhuntError`. The command line prints ``error: <message>`` on one line,
exits with status 2 and prints no traceback. Library users catch the exception.
"""

from __future__ import annotations


class FoxhuntError(Exception):
    """A one-line, user-facing error. ``str(err)`` is the whole message."""

    exit_code = 2


class DataError(FoxhuntError):
    """Market data that cannot be used: names the file, the column and the row where known."""

    def __init__(self, path: str, message: str, column: str | None = None, row: int | None = None):
        where = [str(path)]
        if column is not None:
            where.append(f"column '{column}'")
        if row is not None:
            where.append(f"row {row}")
        super().__init__(f"{', '.join(where)}: {message}")
        self.path, self.column, self.row = str(path), column, row


class ConfigError(FoxhuntError):
    """A configuration key or value that is unknown or out of range."""


class NonFiniteError(FoxhuntError):
    """Training produced NaN or Inf; the message names the epoch and the quantity."""

    exit_code = 3

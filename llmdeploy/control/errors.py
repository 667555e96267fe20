"""The one exception the control plane refuses with: the admin API turns it into {"error": message}."""

from __future__ import annotations


class ControlError(Exception):
    """An operation refused or failed; the message is shown to the user as is."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.message, self.status = message, status

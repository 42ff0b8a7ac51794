"""Errors a Tinker-style backend raises."""

from __future__ import annotations


class UserError(Exception):
    """The request itself is wrong (an unknown loss, a malformed tensor, an unknown model or
    checkpoint path): the client must change it. Any other exception is the server's fault."""

"""The error of a launched run that failed (not the user's input: exit status 1), apart from
runtime.launch so that the command line can catch it without importing torch (a cached
`hetsynth plan` then runs without it)."""

from __future__ import annotations


class RunFailed(RuntimeError):
    """A launched run failed; the message names the rank and carries its own error."""

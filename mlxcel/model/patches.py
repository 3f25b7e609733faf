"""Pointing an mlx-lm method at mlxcel's version of it, and back (the executor installs; tests compare both).

Only the device thread runs what is patched; the originals are kept here, by class and name.
"""

from __future__ import annotations

from typing import Any

_originals: dict[tuple[type, str], Any] = {}


def point(owner: type, name: str, replacement: Any) -> bool:
    """``owner.name = replacement``, the original kept; whether it changed."""
    current = getattr(owner, name)
    if current is replacement:
        return False
    _originals[(owner, name)] = current
    setattr(owner, name, replacement)
    return True


def restore(owner: type, name: str, replacement: Any) -> None:
    """Undo ``point`` (only if ``replacement`` is still what ``owner.name`` is)."""
    original = _originals.get((owner, name))
    if original is not None and getattr(owner, name) is replacement:
        setattr(owner, name, original)


def original(owner: type, name: str) -> Any:
    """What ``owner.name`` was before ``point``, or what it is when never pointed."""
    return _originals.get((owner, name), getattr(owner, name))

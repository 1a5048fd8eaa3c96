"""One bounded memo for values that are immutable once made (checked configs, decoded plans)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["memo_get"]

_MISSING = object()


def memo_get(memo: dict, key: Any, make: Callable[[], Any], limit: int = 256) -> Any:
    """``memo[key]``, made (and kept) if missing; a ``make`` that raises keeps nothing. A memo
    holding ``limit`` entries is cleared first: the keys in use are few, and an unbounded one
    would grow with every distinct key a long-running process sees."""
    value = memo.get(key, _MISSING)
    if value is _MISSING:
        value = make()
        if len(memo) >= limit:
            memo.clear()
        memo[key] = value
    return value

"""A decode step over a batch whose rows have no padding and no gaps takes attention without a mask.

mlx-lm's ``BatchKVCache`` makes a (rows, keys) boolean mask every step from
its rows' left padding, which it keeps on the device only. With a mask, the
attention of a one-token query goes to the ragged kernel on CUDA
(``ragged_attention.py``), and elsewhere to MLX's masked path; without
one, to MLX's fused vector kernel, as a plain ``KVCache`` (the floor) does.
When no row has left padding and none has gaps, every key below the write
index is every row's, so the mask is all true and can be left out. On an
H100, 1B shape, one row, under cProfile: the ragged kernel's call was 162
us of a step's host time for 16 layers against 22 us for MLX's fused
attention, and the mask and the kernel check 50 us more
(docs/benchmarks.md, issue 28's eighteenth pass).

Telling "no padding" from the device array would be a read-back, which
waits for the step in flight. So the padding is also kept on the host
where it is set from host values (``__init__``, ``prepare``, ``finalize``
of a prepared right padding, ``extend`` of two known caches,
``batch_rows.filter_by_slices`` and a gapped cache's ``compact``), paired
with the array it describes: any other change makes a new array (the
pair no longer matches, and the mask is made as before), and the two
mlx-lm methods that change it in place (``prepare``, ``finalize``) record
the new values or forget them. ``install()`` points those methods and
``make_mask`` here; only the device thread uses batch caches.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import BatchKVCache

from mlxcel.model import patches

__all__ = ["host_padding", "install", "padding_of", "remember", "uninstall"]


def remember(cache: Any, padding: list[int]) -> None:
    """Record ``padding`` (host ints) as the value of ``cache.left_padding`` as it is now."""
    cache._host_padding = (cache.left_padding, [int(value) for value in padding])


def host_padding(cache: Any) -> list[int] | None:
    """The cache's left padding as host ints, if it was set from the host since it last changed; else None."""
    known = getattr(cache, "_host_padding", None)
    if known is not None and known[0] is cache.left_padding:
        return known[1]
    return None


def padding_of(cache: Any) -> list[int]:
    """The cache's left padding as host ints: the host copy when it is known, else read back (which waits for
    the array, and so for a step that computes it)."""
    known = host_padding(cache)
    return known if known is not None else [int(value) for value in cache.left_padding.tolist()]


def _init(self: Any, left_padding: list[int]) -> None:
    patches.original(BatchKVCache, "__init__")(self, left_padding)
    remember(self, left_padding)


def _prepare(self: Any, *, left_padding: Any = None, lengths: Any = None, right_padding: Any = None) -> None:
    known = host_padding(self)
    patches.original(BatchKVCache, "prepare")(self, left_padding=left_padding, lengths=lengths,
                                              right_padding=right_padding)
    # mlx-lm adds to the padding in place (the same array object): record the new values, or none.
    if left_padding is not None:
        if known is None:
            self._host_padding = None
        else:
            remember(self, [a + int(b) for a, b in zip(known, left_padding, strict=True)])
    if right_padding is not None and max(right_padding) > 0:  # mlx-lm's condition for keeping it
        self._host_right_padding = (self._right_padding, [int(value) for value in right_padding])


def _finalize(self: Any) -> None:
    known, right = host_padding(self), getattr(self, "_host_right_padding", None)
    pending = self._right_padding
    patches.original(BatchKVCache, "finalize")(self)
    if pending is not None:  # rolled into the left padding, in place
        if known is not None and right is not None and right[0] is pending:
            remember(self, [a + b for a, b in zip(known, right[1], strict=True)])
        else:
            self._host_padding = None
    self._host_right_padding = None


def _extend(self: Any, other: Any) -> None:
    mine, theirs = host_padding(self), host_padding(other)
    length = max(self._idx, other._idx)
    shifts = (length - self._idx, length - other._idx) if self.keys is not None or other.keys is not None else (0, 0)
    patches.original(BatchKVCache, "extend")(self, other)
    if mine is not None and theirs is not None:  # as mlx-lm's: each side right-justified to the longer
        remember(self, [value + shifts[0] for value in mine] + [value + shifts[1] for value in theirs])


def _make_mask(self: Any, N: int, return_array: bool = False, **kwargs: Any) -> Any:  # noqa: N803 (mlx-lm's)
    if N == 1 and kwargs.get("window_size") is None and not any(getattr(self, "gaps", ())):
        padding = host_padding(self)
        if padding is not None and not any(padding):
            return None  # a plain KV cache's answer for one query: every key is every row's
    return patches.original(BatchKVCache, "make_mask")(self, N, return_array=return_array, **kwargs)


_PATCHES = {"__init__": _init, "prepare": _prepare, "finalize": _finalize, "extend": _extend,
            "make_mask": _make_mask}


def install() -> bool:
    """Point ``BatchKVCache``'s padding setters and ``make_mask`` here; whether it changed."""
    changed = [patches.point(BatchKVCache, name, replacement) for name, replacement in _PATCHES.items()]
    return any(changed)


def uninstall() -> None:
    """Undo ``install`` (tests and benchmarks compare both)."""
    for name, replacement in _PATCHES.items():
        patches.restore(BatchKVCache, name, replacement)

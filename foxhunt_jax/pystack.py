"""A reserve of CPython's frame stack, so that calls do not cross the edge of a stack chunk.

CPython 3.11 and 3.12 (and 3.13.0) keep a thread's Python frames in chunks of 16 KiB and give a
chunk back to the system as soon as the frame that opened it returns. A loop whose calls land on
a chunk's edge therefore maps and unmaps a chunk at every call, many times the call's own cost
(python/cpython#142183; later 3.13 and 3.14 releases keep one chunk; measured in
docs/performance.md, "The test suite's time"). JAX's tracing and lowering run such loops at
whatever depth they are called from, so any program that traces meets such edges.

:func:`call_with_reserve` runs a function under one frame that asks for more slots than half a
MiB: CPython opens a chunk of 1 MiB for it, and every frame the function calls then lives in the
rest of that chunk (about 480 KiB, deeper than tracing goes) without crossing an edge. Where the
interpreter is not CPython, the function is simply called.

The CLI runs its commands this way, :mod:`foxhunt_jax.jitcache` its tracing and lowering (often
in worker threads, each with a stack of its own), and the test suite its tests.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

# stack slots (8 bytes each) the reserving frame asks for on top of its own: past 512 KiB, so
# that CPython's chunk size (16 KiB doubled until the frame fits) comes out at 1 MiB
RESERVED_SLOTS = 70_000


def _call(fn: Callable, *args, **kwargs):
    return fn(*args, **kwargs)


if sys.implementation.name == "cpython":
    _call.__code__ = _call.__code__.replace(
        co_stacksize=_call.__code__.co_stacksize + RESERVED_SLOTS)


def call_with_reserve(fn: Callable[..., Any], *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)``, its frames in a fresh 1 MiB stack chunk (see the module)."""
    return _call(fn, *args, **kwargs)


__all__ = ["call_with_reserve", "RESERVED_SLOTS"]

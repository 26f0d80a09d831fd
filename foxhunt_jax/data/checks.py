"""Sanity rules shared by everything that reads market data, and the host-memory check.

:func:`first_price_problem` is the one price rule. The loader applies it to every instrument it
reads (``data check`` and ``train`` both load through it, so they accept exactly the same data)
and :func:`~foxhunt_jax.data.features.build_tables` applies it again to every instrument it is
given, which also covers markets built in memory. The rule, on the prices training uses (after
the Adj Close adjustment), for every bar:

- Open, High, Low and Close are finite and within ``[MIN_PRICE, MAX_PRICE]`` = [1e-15, 1e15]:
  the tables and the environment hold prices as float32, and within this range prices, their
  ratios (at most 1e30) and position sizes stay ordinary float32 numbers;
- Close moves from one bar to the next by at most a factor ``JUMP_FACTOR`` = 10,000 either way.
  Real series stay far inside it (the largest one-bar move of the embedded datasets is AAPL's
  fall of 52% on 2000-09-29, a factor 2.1), so a move beyond it is a typing or unit error, or an
  unadjusted split that an Adj Close column would remove.

:func:`require_memory` refuses work whose estimated bytes exceed the memory available now.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from foxhunt_jax.errors import ConfigError

MIN_PRICE = 1e-15
MAX_PRICE = 1e15
JUMP_FACTOR = 1e4
PRICE_RULE = (f"prices must be finite, within [{MIN_PRICE:g}, {MAX_PRICE:g}], and Close may "
              f"move by at most a factor {JUMP_FACTOR:g} from one bar to the next")


@dataclass(frozen=True)
class PriceProblem:
    """The first bar of an instrument that breaks the price rule.

    ``index`` is the 0-based bar; ``field`` is ``open``, ``high``, ``low`` or ``close``;
    ``message`` says what is wrong in one clause (no location).
    """

    index: int
    field: str
    message: str


def first_price_problem(open_: np.ndarray, high: np.ndarray, low: np.ndarray,
                        close: np.ndarray) -> PriceProblem | None:
    """The earliest bar that breaks the price rule (see the module doc), or None.

    Args:
      open_, high, low, close: [n] prices of one instrument in time order (any float dtype).
    Returns:
      The problem at the smallest bar index; at one bar, a bad value before a jump, and fields
      in the order open, high, low, close.
    """
    columns = {"open": open_, "high": high, "low": low, "close": close}
    best: PriceProblem | None = None
    for name, values in columns.items():
        x = np.asarray(values, np.float64)
        with np.errstate(invalid="ignore"):
            bad = ~(np.isfinite(x) & (x >= MIN_PRICE) & (x <= MAX_PRICE))
        if bad.any():
            i = int(np.argmax(bad))
            if best is None or i < best.index:
                v = float(x[i])
                if not math.isfinite(v):
                    what = f"{name} {v} is not a finite number"
                elif v > MAX_PRICE:
                    what = f"{name} {v:.6g} is above the largest accepted price {MAX_PRICE:g}"
                else:
                    what = f"{name} {v:.6g} is below the smallest accepted price {MIN_PRICE:g}"
                best = PriceProblem(i, name, what)
    c = np.asarray(close, np.float64)
    end = best.index if best is not None else len(c)
    if end >= 2:  # ratios of the bars before the first bad value, all in range
        ratio = c[1:end] / c[:end - 1]
        jump = (ratio > JUMP_FACTOR) | (ratio < 1.0 / JUMP_FACTOR)
        if jump.any():
            j = int(np.argmax(jump))
            return PriceProblem(j + 1, "close", f"close moves from {c[j]:.6g} to {c[j + 1]:.6g} "
                                                f"in one bar, a factor beyond {JUMP_FACTOR:g}")
    return best


# ---------------------------------------------------------------------------------------------
# Host memory


def _cgroup_memory_left() -> int | None:
    """Bytes this process's cgroup (v2) may still allocate, or None without a limit."""
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        used = open("/sys/fs/cgroup/memory.current").read().strip()
    except OSError:
        return None
    if not limit.isdigit() or not used.isdigit():
        return None  # "max": no limit
    return max(int(limit) - int(used), 0)


def available_memory_bytes() -> int | None:
    """Memory that can be allocated now without swapping, or None where it cannot be told.

    Linux: ``MemAvailable`` of /proc/meminfo, capped by the cgroup's limit; elsewhere psutil
    where it is installed, else the free pages of ``os.sysconf``.
    """
    found: int | None = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        found = None
    if found is None:
        try:  # optional: psutil is not a dependency, used only where /proc is missing
            import psutil

            found = int(psutil.virtual_memory().available)
        except ImportError:
            try:
                found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            except (ValueError, OSError, AttributeError):
                found = None
    cgroup = _cgroup_memory_left()
    if cgroup is not None:
        found = cgroup if found is None else min(found, cgroup)
    return found


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def require_memory(needed: int, what: str, keys: Sequence[str],
                   available: int | None = None) -> None:
    """Raises ConfigError when ``needed`` bytes exceed the memory available now.

    ``what`` names the work, ``keys`` the config keys that shrink it; ``available`` defaults to
    :func:`available_memory_bytes` (no check when that cannot be told).
    """
    if available is None:
        available = available_memory_bytes()
    if available is not None and needed > available:
        raise ConfigError(f"{what} needs about {_gib(needed)} of memory, more than the "
                          f"{_gib(available)} available; reduce {' or '.join(keys)}")


__all__ = ["first_price_problem", "PriceProblem", "available_memory_bytes", "require_memory",
           "MIN_PRICE", "MAX_PRICE", "JUMP_FACTOR", "PRICE_RULE"]

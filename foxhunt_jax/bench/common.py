"""Helpers every section shares: timing and statistics, the command line's value parsers,
the variant configs, the run's time budget and the commit the code came from."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

import foxhunt_jax
from foxhunt_jax.config import load_config
from foxhunt_jax.data.features import build_tables
from foxhunt_jax.env.trading import PORTFOLIO_DIM
from foxhunt_jax.training.trainer import Trainer
from pallas_kernels.q_forward import LAYOUTS
from pallas_kernels.tuning import KernelConfig

# the folder holding the running foxhunt_jax package (a checkout or site-packages): child
# processes put it first on their path so that they import the same code
PACKAGE_ROOT = Path(foxhunt_jax.__file__).resolve().parent.parent


def spread(values: list[float]) -> dict:
    """Median, quartiles, min and max of a sample (ms or any unit)."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return {}
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "p25": q[0], "p75": q[2], "min": xs[0],
            "max": xs[-1], "n": len(xs)}


def time_calls(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Wall times in ms of ``fn()`` (each synchronized), after ``warmup`` untimed calls."""
    out = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        if i >= warmup:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def parse_kernel_configs(text: str):
    """``"grouped:128:8,per_action:64:4:64,grouped:128:8:16:128:2"`` -> KernelConfigs
    (layout:block_rows:num_warps, then optionally min_rows, max_chunk (0: the dtype's widest)
    and lookahead)."""
    out = []
    for tok in text.split(","):
        tok = tok.strip()
        if not tok:
            continue
        parts = tok.split(":")
        if not 3 <= len(parts) <= 6 or parts[0] not in LAYOUTS:
            raise argparse.ArgumentTypeError(
                f"kernel config '{tok}' must be layout:rows:warps[:min_rows[:max_chunk"
                f"[:lookahead]]]")
        try:
            rows, warps, *rest = (int(x) for x in parts[1:])
        except ValueError:
            raise argparse.ArgumentTypeError(f"kernel config '{tok}': expected integers") from None
        min_rows, chunk, ahead = (rest + [16, 0, 0][len(rest):])
        if any(r < 16 or r & (r - 1) for r in (rows, min_rows)) or warps < 1 or ahead < 0:
            raise argparse.ArgumentTypeError(f"kernel config '{tok}': rows powers of 2 >= 16")
        out.append(KernelConfig(block_rows=rows, num_warps=warps, layout=parts[0],
                                min_rows=min_rows, max_chunk=chunk or None, lookahead=ahead))
    return tuple(out)


def kernel_config_name(kc) -> str:
    """The inverse of :func:`parse_kernel_configs` for one config (0 = the dtype's widest)."""
    return (f"{kc.layout}:{kc.block_rows}:{kc.num_warps}:{kc.min_rows}:{kc.max_chunk or 0}:"
            f"{kc.lookahead}")


def git_commit() -> str:
    """``git rev-parse --short HEAD`` of the checkout this package runs from (+ "with
    uncommitted changes"); ``FOXHUNT_BENCH_COMMIT`` when set (a copy without git metadata);
    "unknown" for an installed wheel."""
    if os.environ.get("FOXHUNT_BENCH_COMMIT"):
        return os.environ["FOXHUNT_BENCH_COMMIT"]

    def git(*words: str) -> str:
        return subprocess.run(["git", *words], cwd=PACKAGE_ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        top = git("rev-parse", "--show-toplevel")
        # a wheel installed into a virtualenv inside some other repository is not that commit
        if not top or Path(top).resolve() != PACKAGE_ROOT:
            return "unknown"
        rev = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if not rev:
        return "unknown"
    return rev + (" with uncommitted changes" if dirty else "")


class Deadline:
    """The run's time budget: sections skip work that would start after it."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()

    def ok(self, need: float = 0.0) -> bool:
        return self.left() > need


def build_trainer(cfg, market) -> Trainer:
    """The trainer of ``cfg`` on one device: the single-device figures, whatever is visible."""
    return Trainer.build(cfg, market=market, devices=jax.devices()[:1])


def variant_cfg(args, backend: str, dtype: str, extra: list[str] = ()):
    """The run's config (``args.config`` and ``args.overrides``) for one backend and dtype, with
    ``extra`` overrides."""
    return load_config(args.config, list(args.overrides) + [f"network.backend={backend}",
                                                           f"network.dtype={dtype}", *extra])


SHORT_DTYPE = {"float32": "f32", "bfloat16": "bf16"}


def vname(backend: str, dtype: str) -> str:
    return f"{backend}/{SHORT_DTYPE[dtype]}"


def per_second(count: float, ms: float) -> float | None:
    """``count`` per second at ``ms``; None where the time measured no more than zero (a phase
    that finished before its clock was read, or shorter than the timer's resolution, on a tiny
    workload)."""
    return count * 1e3 / ms if ms > 0 else None


def format_rate(per_s: float | None) -> str:
    """A rate for the tables: ``1.234e9`` from 10 million a second up, 3 digits below it, n/a
    where it was not measured."""
    if per_s is None:
        return "n/a"
    return f"{per_s / 1e9:.3f}e9" if per_s >= 1e7 else f"{per_s:.3g}"


def rel_err(got, ref) -> float:
    """Largest absolute difference relative to the reference's largest magnitude."""
    return float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def obs_dim_of(cfg, market) -> int:
    """The observation width of ``cfg``'s features on ``market`` plus the portfolio's."""
    tables = build_tables(market, cfg.data.splits, cfg.env.episode_length,
                          features=cfg.data.features, split_dates=cfg.data.split_dates)
    return int(tables.features.shape[1]) + PORTFOLIO_DIM


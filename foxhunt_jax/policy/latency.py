"""Latency of a live decision: one :meth:`Policy.step` (the env's step onto a new bar, then the
greedy decision at it) for N instruments at once, through the library and through the export.

Times are wall-clock per call on this process's default device, each call waited for
(``block_until_ready``), after ``warmup`` calls that compile. Bars are random (normalized
features from a standard normal, positive prices): the time does not depend on the values.
Feature computation from raw bars (host NumPy) is not part of the step and not timed.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from foxhunt_jax.policy.export import export_policy
from foxhunt_jax.policy.policy import BarInputs, Policy, Position
from foxhunt_jax.policy.standalone import ExportedPolicy


def random_bars(n: int, count: int, num_features: int, seed: int = 0) -> list[BarInputs]:
    """``count`` successive random bars of ``n`` instruments with ``num_features`` features
    (host float32 arrays)."""
    rng = np.random.default_rng(seed)
    out, close = [], np.full((n,), 100.0)
    for _ in range(count):
        ret = rng.normal(0.0, 0.01, n)
        open_ = close
        close = close * np.exp(ret)
        high = np.maximum(open_, close) * (1 + np.abs(rng.normal(0, 0.003, n)))
        low = np.minimum(open_, close) * (1 - np.abs(rng.normal(0, 0.003, n)))
        f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
        out.append(BarInputs(
            features=f32(np.clip(rng.normal(size=(n, num_features)), -10, 10)),
            open=f32(open_), high=f32(high), low=f32(low), close=f32(close),
            sigma=f32(np.full((n,), 0.01))))
    return out


def _times(call, bars, state, warmup: int) -> np.ndarray:
    """Per-call seconds of ``state = call(state, bar)`` over ``bars`` (first ``warmup`` not
    counted)."""
    out = []
    for i, bar in enumerate(bars):
        t0 = time.perf_counter()
        _, state = call(state, bar)
        jax.block_until_ready(state)
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return np.asarray(out)


def _summary(seconds: np.ndarray) -> dict:
    us = seconds * 1e6
    return {"median_us": float(np.median(us)), "p99_us": float(np.percentile(us, 99)),
            "calls": int(us.size)}


def measure(run_dir: str | Path, instruments=(1, 1000), calls: int = 200, warmup: int = 5,
            export_dir: str | Path | None = None) -> dict:
    """``{"device": ..., "library": {N: {median_us, p99_us, calls}}, "exported": {...}}``:
    one step per call for each N in ``instruments``; the exported path runs the export of
    the run (written to a temporary folder unless ``export_dir`` holds one)."""
    policy = Policy.load(run_dir, agent="last")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(export_dir) if export_dir else export_policy(policy, Path(tmp) / "export")
        exported = ExportedPolicy(folder)
        result = {"device": str(jax.devices()[0]), "library": {}, "exported": {}}
        for n in instruments:
            bars = random_bars(int(n), calls + warmup + 1, len(policy.cfg.data.features))
            first = jax.tree.map(jax.numpy.asarray, bars[0])
            _, state = policy.start_bar(first, Position())
            result["library"][int(n)] = _summary(_times(policy.step, bars[1:], state, warmup))
            as_dict = [{k: getattr(b, k) for k in b.__dataclass_fields__} for b in bars]
            _, xstate = exported.decide(as_dict[0])
            result["exported"][int(n)] = _summary(_times(exported.step, as_dict[1:], xstate,
                                                         warmup))
    return result


__all__ = ["measure", "random_bars"]

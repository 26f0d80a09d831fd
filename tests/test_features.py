"""Features, splits and normalization: values against a per-bar loop reference, no look-ahead."""

from __future__ import annotations

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax.config import EnvConfig
from foxhunt_jax.data.features import (
    FEATURE_NAMES,
    SPLITS,
    WARMUP,
    build_tables,
    instrument_features,
)
from foxhunt_jax.data.loader import load_market
from foxhunt_jax.env import trading
from foxhunt_jax.errors import ConfigError, DataError
from reference_env import random_market, replace_bars

L = 20


def end_together(market):
    """The market with each instrument's daily bars moved to end on the same day, so that the
    calendar windows cut every instrument (they all start on one day in ``random_market``)."""
    n = max(len(ins) for ins in market.instruments)
    moved = tuple(dataclasses.replace(ins, timestamps=ins.timestamps
                                      + np.timedelta64(n - len(ins), "D"))
                  for ins in market.instruments)
    return dataclasses.replace(market, instruments=moved)


@pytest.fixture(scope="module")
def market():
    # 356, 236 and 26 tradable days, all ending on the same day: the calendar windows give
    # R0 249 / 54 / 53 rows, R1 129 / 54 / 53 and R2 only 26 test rows
    return end_together(random_market(1, lengths=(420, 300, 90)))


@pytest.fixture(scope="module")
def tables(market):
    return build_tables(market, episode_length=L)


def _ref_row(ins, t: int) -> dict:
    """All raw features of bar t from explicit slices of bars <= t (float64 loop reference)."""
    o, h, lo, c, v = ins.open, ins.high, ins.low, ins.close, ins.volume
    r = lambda j: math.log(c[j] / c[j - 1])  # noqa: E731
    rets = lambda n: np.array([r(j) for j in range(t - n + 1, t + 1)])  # noqa: E731
    f = {}
    for n in (1, 2, 5, 10, 20, 60):
        f[f"ret_{n}"] = math.log(c[t] / c[t - n])
    for k in (1, 2, 3, 4):
        f[f"ret_1_lag{k}"] = r(t - k)
    vols = {n: float(np.sqrt(np.mean((rets(n) - rets(n).mean()) ** 2))) for n in (5, 10, 20, 60)}
    for n in vols:
        f[f"vol_{n}"] = vols[n]
    f["vol_ratio_5_60"] = math.log(vols[5] / vols[60])
    f["vol_ratio_20_60"] = math.log(vols[20] / vols[60])
    f["ret_1_z"] = r(t) / vols[20]
    f["bar_pos"] = (c[t] - lo[t]) / (h[t] - lo[t]) if h[t] > lo[t] else 0.5
    f["bar_range"] = math.log(h[t] / lo[t])
    f["bar_body"] = math.log(c[t] / o[t])
    f["upper_wick"] = math.log(h[t] / max(o[t], c[t]))
    f["lower_wick"] = math.log(min(o[t], c[t]) / lo[t])
    f["gap"] = math.log(o[t] / c[t - 1])
    for n in (20, 60):
        hh, ll = max(h[t - n + 1: t + 1]), min(lo[t - n + 1: t + 1])
        f[f"range_pos_{n}"] = (c[t] - ll) / (hh - ll) if hh > ll else 0.5
    f["range_vol_20"] = sum(math.log(h[j] / lo[j]) for j in range(t - 19, t + 1)) / 20
    f["high_dist_60"] = math.log(c[t] / max(h[t - 59: t + 1]))
    f["low_dist_60"] = math.log(c[t] / min(lo[t - 59: t + 1]))
    for n in (20, 60):
        w = np.log1p(v[t - n + 1: t + 1])
        sd = float(np.sqrt(np.mean((w - w.mean()) ** 2)))
        f[f"volume_z_{n}"] = (math.log1p(v[t]) - w.mean()) / sd if sd > 0 else 0.0
    for n in (5, 10, 20, 50):
        f[f"ma_gap_{n}"] = math.log(c[t] / (sum(c[t - n + 1: t + 1]) / n))
    return f


def test_shapes_dtypes_and_names(market, tables):
    T = sum(len(i) - WARMUP for i in market.instruments)
    F = len(FEATURE_NAMES)
    assert F == 34 and FEATURE_NAMES[0] == "ret_1" and len(set(FEATURE_NAMES)) == F
    assert tables.feature_names == FEATURE_NAMES and tables.num_features == F
    chex.assert_shape(tables.features, (T, F))
    chex.assert_type(tables.features, np.float32)
    for a in (tables.open, tables.high, tables.low, tables.close, tables.sigma,
              tables.last_log_return):
        chex.assert_shape(a, (T,))
        chex.assert_type(a, np.float32)
    chex.assert_type(tables.instrument, np.int32)
    assert tables.timestamps.dtype == np.dtype("datetime64[ns]")
    chex.assert_shape([tables.norm_mean, tables.norm_std], (F,))
    for s in SPLITS:
        chex.assert_shape(tables.segments[s], (3, 2))
        assert tables.segments[s].dtype == np.int64 and tables.starts[s].dtype == np.int32
    assert np.all(np.isfinite(tables.features)) and np.abs(tables.features).max() <= 10
    assert tables.instrument_names == ("R0", "R1", "R2")
    assert tables.bars_per_year == market.bars_per_year and tables.episode_length == L
    assert tables.bar_seconds == 86400.0


def test_raw_features_match_loop_reference(market):
    rng = np.random.default_rng(0)
    for ins in market.instruments:
        raw = instrument_features(ins)
        chex.assert_shape(raw, (len(ins), len(FEATURE_NAMES)))
        assert np.all(np.isfinite(raw[WARMUP:]))
        for t in rng.integers(WARMUP, len(ins), 12):
            ref = _ref_row(ins, int(t))
            np.testing.assert_allclose(raw[t], [ref[n] for n in FEATURE_NAMES], rtol=1e-9,
                                       atol=1e-12, err_msg=f"{ins.name} bar {t}")


def test_normalization_uses_train_rows(market, tables):
    raw = np.concatenate([instrument_features(i)[WARMUP:] for i in market.instruments])
    rows = np.concatenate([np.arange(a, b + 1) for a, b in tables.segments["train"]])
    np.testing.assert_allclose(tables.norm_mean, raw[rows].mean(0), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(tables.norm_std, raw[rows].std(0), rtol=1e-6)
    expect = np.clip((raw - raw[rows].mean(0)) / raw[rows].std(0), -10, 10)
    np.testing.assert_allclose(tables.features, expect, rtol=1e-4, atol=1e-4)
    # train rows are standardized exactly (before clipping, which touches few of them)
    z = tables.features[rows]
    assert np.all(np.abs(z.mean(0)) < 0.05) and np.all(np.abs(z.std(0) - 1) < 0.05)


def test_sigma_prices_and_last_return(market, tables):
    rng = np.random.default_rng(1)
    for i, ins in enumerate(market.instruments):
        first = int(np.flatnonzero(tables.instrument == i)[0])
        np.testing.assert_allclose(tables.close[first: first + len(ins) - WARMUP],
                                   ins.close[WARMUP:], rtol=1e-7)
        for t in rng.integers(WARMUP, len(ins), 10):
            row = first + int(t) - WARMUP
            r = np.log(ins.close[t - 19: t + 1] / ins.close[t - 20: t])
            assert tables.sigma[row] == pytest.approx(max(r.std(), 1e-4), rel=1e-6)
            assert tables.last_log_return[row] == pytest.approx(
                math.log(ins.close[t] / ins.close[t - 1]), rel=1e-6, abs=1e-9)
            assert tables.timestamps[row] == ins.timestamps[t]
            assert tables.instrument[row] == i


def test_sigma_floor():
    m = random_market(5, lengths=(200,), vol=1e-7)
    t = build_tables(m, episode_length=10)
    assert np.all(t.sigma == np.float32(1e-4))


def test_splits_and_starts_are_exact(market, tables):
    # the calendar rule by hand: the distinct tradable days of all instruments, cut at the
    # 70% and 85% points; each bar goes to the window its day falls in
    days = sorted({int(d) for ins in market.instruments
                   for d in ins.timestamps[WARMUP:].astype("datetime64[D]").astype(np.int64)})
    first_val, first_test = days[round(len(days) * 0.7)], days[round(len(days) * 0.85)]
    offset = 0
    for i, ins in enumerate(market.instruments):
        own = ins.timestamps[WARMUP:].astype("datetime64[D]").astype(np.int64)
        rows = {"train": [r for r, d in enumerate(own) if d < first_val],
                "validation": [r for r, d in enumerate(own) if first_val <= d < first_test],
                "test": [r for r, d in enumerate(own) if d >= first_test]}
        for s in SPLITS:
            a, b = (int(x) - offset for x in tables.segments[s][i])
            if len(rows[s]) >= L + 1:
                assert list(range(a, b + 1)) == rows[s], (ins.name, s)
            else:  # too few bars in the window: the instrument contributes none there
                assert b == a - 1, (ins.name, s)
        offset += len(own)
    assert [tuple(int(x) for x in tables.segments["train"][2])] == [(592, 591)]
    for s in SPLITS:
        brute = [st for a, b in tables.segments[s] for st in range(a, b + 1) if st + L <= b]
        np.testing.assert_array_equal(tables.starts[s], brute)
    # the short instrument (26 rows, all in the test window) trades only there
    assert np.any(tables.instrument[tables.starts["test"]] == 2)
    assert not np.any(tables.instrument[tables.starts["train"]] == 2)
    assert np.any(tables.instrument[tables.starts["validation"]] == 1)
    assert str(tables.split_dates.validation_start)[:10] == str(np.datetime64(first_val, "D"))


def test_split_without_start_raises():
    m = random_market(2, lengths=(300, 180))
    with pytest.raises(DataError, match=r"split 'validation' \(from 2001-08-18 to before "
                                        r"2001-09-23\).*needs 101 bars"):
        build_tables(m, episode_length=100)
    with pytest.raises(ConfigError, match="data.splits"):
        build_tables(m, splits=(0.5, 0.6, 0.1))
    with pytest.raises(ConfigError, match="episode_length"):
        build_tables(m, episode_length=0)


def test_bad_prices_raise_data_error():
    m = random_market(4, lengths=(300, 300))
    bad = replace_bars(m, 1, 150, np.random.default_rng(0), last=150)
    ins = bad.instruments[1]
    ins.close[150] = 0.0  # the arrays are fresh copies
    with pytest.raises(DataError, match=r"random:4: instrument R1, bar 150 \(2001-05-31 "
                                        r"00:00:00\): close 0 is below the smallest accepted"):
        build_tables(bad, episode_length=10)


def test_zero_volume_gives_zero_volume_feature():
    m = random_market(3, lengths=(300,), zero_volume=True)
    raw = instrument_features(m.instruments[0])
    for name in ("volume_z_20", "volume_z_60"):
        assert np.all(raw[WARMUP:, FEATURE_NAMES.index(name)] == 0)
    t = build_tables(m, episode_length=10)
    assert np.all(np.isfinite(t.features))


@pytest.fixture(scope="module")
def observe_after_steps():
    """jit: start flat at ``bar - 5``, take 5 fixed steps, return the observation at ``bar``."""
    actions = jnp.array([[4, 0, 1], [4, 0, 1], [0, 2, 2], [1, 1, 0], [1, 1, 0]], jnp.int32)

    @jax.jit
    def run(params, bar):
        _, state = trading.reset_at(bar - 5, params)
        for a in actions:
            _, state, *_ = trading.step_env(jax.random.key(0), state, a, params)
        return trading.observation(state, params), trading.reset_at(bar, params)[0]

    return run


def test_no_look_ahead(market, tables, observe_after_steps):
    """Replacing bars t+1..end of an instrument (test region) leaves every row <= t unchanged."""
    rng = np.random.default_rng(7)
    cfg = EnvConfig(episode_length=L, time_barrier=3)
    params0 = trading.make_params(tables, cfg, "test")
    a, b = (int(x) for x in tables.segments["test"][0])
    for row in [int(r) for r in rng.integers(a, b, 4)] + [a]:
        t = row - int(tables.segments["train"][0, 0]) + WARMUP  # bar index in instrument 0
        new_market = replace_bars(market, 0, t + 1, rng)
        new = build_tables(new_market, episode_length=L)
        np.testing.assert_array_equal(new.norm_mean, tables.norm_mean)
        np.testing.assert_array_equal(new.norm_std, tables.norm_std)
        same = ~((tables.instrument == 0) & (np.arange(len(tables.close)) > row))
        for k in ("features", "open", "high", "low", "close", "sigma", "last_log_return"):
            np.testing.assert_array_equal(getattr(new, k)[same], getattr(tables, k)[same], k)
        assert not np.array_equal(new.features[row + 1: b + 1], tables.features[row + 1: b + 1])
        params1 = trading.make_params(new, cfg, "test")
        for o0, o1 in zip(observe_after_steps(params0, row), observe_after_steps(params1, row)):
            np.testing.assert_array_equal(np.asarray(o0), np.asarray(o1))


def test_statistics_ignore_validation_and_test(market, tables):
    rng = np.random.default_rng(8)
    for split in ("validation", "test"):
        for i in (0, 1):
            a, b = (int(x) for x in tables.segments[split][i])
            row = int(rng.integers(a, b + 1))
            t = row - int(tables.segments["train"][i, 0]) + WARMUP
            new = build_tables(replace_bars(market, i, t, rng, last=t), episode_length=L)
            np.testing.assert_array_equal(new.norm_mean, tables.norm_mean)
            np.testing.assert_array_equal(new.norm_std, tables.norm_std)
            np.testing.assert_array_equal(new.features[:row], tables.features[:row])
            assert not np.array_equal(new.features[row], tables.features[row])
    # a change inside the train split does move the statistics (the test above is not vacuous)
    t = WARMUP + 10
    new = build_tables(replace_bars(market, 0, t, rng, last=t), episode_length=L)
    assert not np.array_equal(new.norm_mean, tables.norm_mean)


def test_real_us_stocks():
    m = load_market(["builtin:us_stocks_daily"])
    t = build_tables(m)
    assert t.features.shape == (sum(len(i) - WARMUP for i in m.instruments), 34)
    assert np.all(np.isfinite(t.features)) and np.all(t.sigma >= 1e-4)
    assert 240 < t.bars_per_year < 260
    assert t.instrument_names == ("AAPL", "FB", "GOOG", "IBM", "MSFT")
    for s in SPLITS:
        st = t.starts[s]
        assert st.size > 0
        assert np.all(t.instrument[st] == t.instrument[st + 100])
    # FB (132 rows after warm-up, from 2012-08) trades only in the test window (from 2011-04)
    assert np.any(t.instrument[t.starts["test"]] == 1)
    assert not np.any(t.instrument[np.concatenate([t.starts["train"], t.starts["validation"]])]
                      == 1)


def test_real_eurusd_hourly():
    t = build_tables(load_market(["builtin:eurusd_hourly"]))
    assert t.features.shape == (6225 - WARMUP, 34) and np.all(np.isfinite(t.features))
    assert 6000 < t.bars_per_year < 6500 and t.bar_seconds == 3600.0
    assert [len(t.starts[s]) for s in SPLITS] == [
        b - a + 1 - 100 for a, b in (t.segments[s][0] for s in SPLITS)]

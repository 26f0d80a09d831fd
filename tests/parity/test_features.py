"""Features, splits and normalization: values against a per-bar loop reference, no look-ahead;
the feature registry and the config key ``data.features`` (choosing, patterns, user features,
errors), and a tiny run on a chosen list with a user feature."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import foxhunt_jax
from foxhunt_jax import api
from foxhunt_jax.cli import main
from foxhunt_jax.config import EnvConfig, load_config
from foxhunt_jax.data import features as feats
from foxhunt_jax.data.features import (
    DEFAULT_FEATURES,
    MAX_WINDOW,
    SPLITS,
    WARMUP,
    LookAheadError,
    build_tables,
    check_no_lookahead,
    instrument_features,
    random_bars,
    register,
    registered,
    unregister,
)
from foxhunt_jax.data.loader import load_market
from foxhunt_jax.data.market import Instrument
from foxhunt_jax.env import trading
from foxhunt_jax.errors import ConfigError, DataError
from foxhunt_jax.policy.policy import Policy
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
    F = len(DEFAULT_FEATURES)
    assert F == 34 and DEFAULT_FEATURES[0] == "ret_1" and len(set(DEFAULT_FEATURES)) == F
    assert tables.feature_names == DEFAULT_FEATURES and tables.num_features == F
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
        chex.assert_shape(raw, (len(ins), len(DEFAULT_FEATURES)))
        assert np.all(np.isfinite(raw[WARMUP:]))
        for t in rng.integers(WARMUP, len(ins), 12):
            ref = _ref_row(ins, int(t))
            np.testing.assert_allclose(raw[t], [ref[n] for n in DEFAULT_FEATURES], rtol=1e-9,
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
        assert np.all(raw[WARMUP:, DEFAULT_FEATURES.index(name)] == 0)
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


# ---------------------------------------------------------------------------------------------
# The registry and data.features

HISTORICAL_ORDER = (  # the 34 columns every run before data.features existed was trained on
    "ret_1", "ret_2", "ret_5", "ret_10", "ret_20", "ret_60",
    "ret_1_lag1", "ret_1_lag2", "ret_1_lag3", "ret_1_lag4",
    "vol_5", "vol_10", "vol_20", "vol_60", "vol_ratio_5_60", "vol_ratio_20_60", "ret_1_z",
    "bar_pos", "bar_range", "bar_body", "upper_wick", "lower_wick", "gap",
    "range_pos_20", "range_pos_60", "range_vol_20", "high_dist_60", "low_dist_60",
    "volume_z_20", "volume_z_60", "ma_gap_5", "ma_gap_10", "ma_gap_20", "ma_gap_50",
)
TINY = ["network.trunk=[16]", "network.head=16", "network.atoms=5", "curiosity.hidden=8",
        "curiosity.embed=4", "env.episode_length=8", "train.num_episodes=16",
        "train.train_steps=2", "replay.capacity=512", "train.batch_size=16",
        "train.validation_windows=4", "train.epochs=1"]


@pytest.fixture
def registering():
    """``registering(name, fn, window)`` registers a user feature for one test."""
    names = []

    def reg(name, fn, window, meaning=""):
        register(name, fn, window, meaning)
        names.append(name)

    yield reg
    for name in names:
        unregister(name)


def test_default_is_every_builtin_in_the_historical_order():
    assert DEFAULT_FEATURES == HISTORICAL_ORDER
    assert load_config().data.features == HISTORICAL_ORDER
    assert [f.name for f in registered() if f.builtin] == list(HISTORICAL_ORDER)
    for f in registered():
        assert 1 <= f.window <= MAX_WINDOW and f.meaning, f.name


def test_docs_list_every_builtin_with_its_window_and_meaning():
    text = (Path(__file__).resolve().parents[2] / "docs" / "features.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (\d+) \| (.+) \|$", text, flags=re.M)
    assert rows == [(f.name, str(f.window), f.meaning) for f in registered() if f.builtin]


@pytest.mark.parametrize("name", DEFAULT_FEATURES)
def test_builtin_window_is_the_bars_a_value_reads(name):
    """NaN before bar window - 1, finite from it on; bars before t - window + 1 do not count."""
    window = feats.feature(name).window
    bars = random_bars(200, seed=3)
    col = instrument_features(bars, [name])[:, 0]
    assert np.all(np.isnan(col[: window - 1])) and np.all(np.isfinite(col[window - 1:]))
    t = 150
    older = random_bars(200, seed=4)
    mixed = Instrument(bars.name, bars.source, bars.timestamps, **{
        k: np.concatenate([getattr(older, k)[: t - window + 1], getattr(bars, k)[t - window + 1:]])
        for k in ("open", "high", "low", "close", "volume")})
    np.testing.assert_array_equal(instrument_features(mixed, [name])[t:, 0], col[t:])


@pytest.mark.parametrize("name", [f.name for f in registered()])
def test_every_registered_feature_passes_the_no_lookahead_check(name):
    check_no_lookahead(name)


LEAKS = {
    "next_return": (lambda b: np.append(np.log(b.close[1:] / b.close[:-1]), 0.0), 1),
    "centered_mean": (lambda b: b.close / np.convolve(b.close, np.ones(5) / 5, "same"), 3),
    "demeaned": (lambda b: b.close - b.close.mean(), 1),
    "last_close": (lambda b: b.close / b.close[-1], 1),
}


@pytest.mark.parametrize("leak", sorted(LEAKS))
def test_the_check_catches_a_leaking_feature(leak, registering):
    registering(leak, *LEAKS[leak])
    with pytest.raises(LookAheadError, match=f"feature '{leak}' looks ahead: its value at bar"):
        check_no_lookahead(leak)


def test_the_check_catches_values_missing_after_the_window(registering):
    registering("late_nan", lambda b: np.where(np.arange(len(b.close)) < 40, np.nan, b.close), 5)
    with pytest.raises(LookAheadError, match="'late_nan' is not finite at bar 4 "):
        check_no_lookahead("late_nan")


def test_register_refuses_bad_definitions(registering):
    good = lambda b: b.close  # noqa: E731
    for args, message in [(("ret_1", good, 2), "already built-in"),
                          (("vol_*", good, 2), "must be a letter"),
                          (("x", good, 0), "window must be an integer in 1..65"),
                          (("x", good, MAX_WINDOW + 1), "window must be"),
                          (("x", 3.0, 1), "must be callable")]:
        with pytest.raises(ConfigError, match=message):
            register(*args)
    registering("mine", good, 1)
    with pytest.raises(ConfigError, match="'mine' is already registered"):
        register("mine", good, 1)
    with pytest.raises(ConfigError, match="not a registered user feature"):
        unregister("ret_1")
    registering("bad_shape", lambda b: b.close[:-1], 1)
    with pytest.raises(ConfigError, match=r"'bad_shape' returned shape \(199,\) for 200 bars"):
        instrument_features(random_bars(200), ["ret_1", "bad_shape"])


def test_config_resolves_patterns_and_refuses_bad_lists():
    cfg = load_config(None, ["data.features=[gap, 'ma_gap_*', ret_1]"])
    assert cfg.data.features == ("gap", "ma_gap_5", "ma_gap_10", "ma_gap_20", "ma_gap_50", "ret_1")
    assert load_config(None, ["data.features=['*']"]).data.features == DEFAULT_FEATURES
    for value, message in [("[vol_5, 'vol_*']", "names feature 'vol_5' twice"),
                           ("[]", "must name at least one feature"),
                           ("['nothing_*']", "unknown pattern 'nothing_\\*'"),
                           ("[ret_1, Ret_2]", "unknown feature 'Ret_2' \\(choices: ret_1, ret_2")]:
        with pytest.raises(ConfigError, match=f"config key 'data.features'.*{message}"):
            load_config(None, [f"data.features={value}"])


def test_cli_unknown_feature_is_one_error_line_exit_2(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--config", "smoke", "--set", "data.features=[ret_1, nope]",
                 "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert err.startswith("error: config key 'data.features': unknown feature 'nope' (choices: "
                          + ", ".join(DEFAULT_FEATURES))
    assert not out.exists()


def test_a_chosen_subset_is_the_default_tables_columns(market, tables):
    names = ("gap", "vol_20", "ret_1")
    sub = build_tables(market, episode_length=L, features=names)
    cols = [DEFAULT_FEATURES.index(n) for n in names]
    assert sub.feature_names == names and sub.num_features == 3
    np.testing.assert_array_equal(sub.features, tables.features[:, cols])
    np.testing.assert_array_equal(sub.norm_mean, tables.norm_mean[cols])
    np.testing.assert_array_equal(sub.norm_std, tables.norm_std[cols])
    for k in ("close", "sigma", "last_log_return", "instrument"):
        np.testing.assert_array_equal(getattr(sub, k), getattr(tables, k))


def _close_vs_sma_30(bars):
    return np.log(bars.close / bars.frame()["close"].rolling(30).mean().to_numpy())


def test_a_user_feature_is_a_column_of_the_tables(market, registering):
    registering("close_vs_sma_30", _close_vs_sma_30, 30, "log(C / SMA_30(C)) through pandas")
    t = build_tables(market, episode_length=L, features=("close_vs_sma_30", "ma_gap_20"))
    raw = np.concatenate([instrument_features(i, ["close_vs_sma_30"])[WARMUP:, 0]
                          for i in market.instruments])
    ins = market.instruments[0]
    c = np.asarray(ins.close)
    ref = [math.log(c[k] / c[k - 29: k + 1].mean()) for k in range(WARMUP, len(ins))]
    np.testing.assert_allclose(raw[: len(ref)], ref, rtol=1e-9, atol=1e-12)
    rows = np.concatenate([np.arange(a, b + 1) for a, b in t.segments["train"]])
    np.testing.assert_allclose(t.norm_mean[0], raw[rows].mean(), rtol=1e-6)
    np.testing.assert_allclose(t.features[:, 0], np.clip((raw - raw[rows].mean())
                                                         / raw[rows].std(), -10, 10),
                               rtol=1e-4, atol=1e-4)


def test_a_tiny_run_on_a_chosen_list_with_a_user_feature(tmp_path, registering):
    """F follows data.features through the tables, the network, normalization.json and a
    policy loaded from the run; the run needs its user feature registered to be loaded."""
    registering("close_vs_sma_30", _close_vs_sma_30, 30)
    cfg = load_config("smoke", TINY + ["data.features=[ret_1, 'vol_*', close_vs_sma_30]"])
    names = ("ret_1", "vol_5", "vol_10", "vol_20", "vol_60", "vol_ratio_5_60",
             "vol_ratio_20_60", "close_vs_sma_30")
    assert cfg.data.features == names
    out = tmp_path / "run"
    result = api.train(cfg, out, progress=False, log=lambda s: None, final_report=False)
    assert result.trainer.tables.feature_names == names
    assert result.trainer.obs_dim == len(names) + trading.PORTFOLIO_DIM
    first = result.state.agent.params["params"]["trunk_0"]["kernel"]
    assert first.shape[0] == len(names) + trading.PORTFOLIO_DIM
    stats = json.loads((out / "normalization.json").read_text())
    assert stats["feature_names"] == list(names)
    decisions = Policy.load(out).decide(load_market(["builtin:us_stocks_daily"]))
    assert len(decisions) == 5
    unregister("close_vs_sma_30")
    try:
        with pytest.raises(ConfigError, match="unknown feature 'close_vs_sma_30'"):
            Policy.load(out)
    finally:
        register("close_vs_sma_30", _close_vs_sma_30, 30)


def test_docs_example_of_a_user_feature_runs(monkeypatch):
    """The python block of docs/features.md, with ``train`` recording its config (the tiny run
    above trains on such a list)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "features.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    seen = []
    monkeypatch.setattr(foxhunt_jax, "train", lambda cfg, out_dir: seen.append(cfg))
    try:
        exec(compile(block, "docs/features.md", "exec"), {})
        assert seen[0].data.features == ("ret_1", "vol_5", "vol_10", "vol_20", "vol_60",
                                         "vol_ratio_5_60", "vol_ratio_20_60", "close_vs_sma_30")
    finally:
        unregister("close_vs_sma_30")

"""Splits by calendar time: one train / validation / test boundary for all instruments."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from foxhunt_jax.config import from_dict
from foxhunt_jax.data.features import SPLITS, WARMUP, build_tables
from foxhunt_jax.data.loader import load_market
from foxhunt_jax.errors import ConfigError, DataError
from reference_env import random_market, replace_bars

L = 20


def staggered(seed: int, lengths, offsets_days) -> object:
    """``random_market`` with instrument i's daily bars starting ``offsets_days[i]`` days late."""
    market = random_market(seed, lengths=lengths)
    moved = tuple(dataclasses.replace(ins, timestamps=ins.timestamps + np.timedelta64(d, "D"))
                  for ins, d in zip(market.instruments, offsets_days))
    return dataclasses.replace(market, instruments=moved)


def window_times(tables, split: str) -> np.ndarray:
    rows = np.concatenate([np.arange(a, b + 1) for a, b in tables.segments[split]])
    return tables.timestamps[rows]


def assert_ordered_in_time(tables) -> None:
    """No train bar of any instrument at or after the first validation bar of any instrument,
    no validation bar at or after the first test bar."""
    train, val, test = (window_times(tables, s) for s in SPLITS)
    assert train.max() < val.min() and val.max() < test.min()
    dates = tables.split_dates
    assert train.max() < dates.validation_start <= val.min()
    assert val.max() < dates.test_start <= test.min()
    # every traded bar (an episode's bars s .. s + L) lies in its start's window
    for split, times in zip(SPLITS, (train, val, test)):
        starts = tables.starts[split]
        assert times.min() <= tables.timestamps[starts].min()
        assert tables.timestamps[starts + L].max() <= times.max()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_windows_are_ordered_across_instruments(seed):
    rng = np.random.default_rng(seed)
    lengths = tuple(int(n) for n in rng.integers(200, 600, 4))
    market = staggered(seed, lengths, [int(d) for d in rng.integers(0, 300, 4)])
    tables = build_tables(market, episode_length=L)
    assert_ordered_in_time(tables)
    # the boundaries: the 70% and 85% points of the pooled distinct tradable times
    times = np.unique(np.concatenate([i.timestamps[WARMUP:] for i in market.instruments]))
    assert tables.split_dates.validation_start == times[round(times.size * 0.7)]
    assert tables.split_dates.test_start == times[round(times.size * 0.85)]


def test_real_multi_instrument_data():
    tables = build_tables(load_market(["builtin:us_stocks_daily"]), episode_length=100)
    assert_ordered_in_time(tables)
    assert str(tables.split_dates.validation_start)[:10] == "2009-05-06"
    assert str(tables.split_dates.test_start)[:10] == "2011-04-01"


def test_explicit_split_dates():
    market = staggered(3, (500, 400), (0, 60))
    tables = build_tables(market, episode_length=L, split_dates=("2001-09-01", "2002-01-15"))
    assert_ordered_in_time(tables)
    assert tables.split_dates.rule == "data.split_dates"
    assert window_times(tables, "validation").min() == np.datetime64("2001-09-01", "ns")
    assert window_times(tables, "test").min() == np.datetime64("2002-01-15", "ns")
    # a window left without any episode names its dates
    with pytest.raises(DataError, match=r"split 'test' \(from 2003-01-01\)"):
        build_tables(market, episode_length=L, split_dates=("2001-09-01", "2003-01-01"))


@pytest.mark.parametrize("dates,needle", [
    (["2012-01-01"], "must be empty or two dates"),
    (["2012-01-01", "soon"], "must hold ISO dates"),
    (["2012-01-01", "2011-01-01"], "validation_start < test_start"),
])
def test_bad_split_dates_config(dates, needle):
    with pytest.raises(ConfigError, match=needle):
        from_dict({"data": {"split_dates": dates}})


@pytest.mark.parametrize("rows,needle", [
    (-1, r"'data.min_table_rows' must be in 0\.\.16777216, got -1"),
    ((1 << 24) + 1, r"'data.min_table_rows' must be in 0\.\.16777216"),
    (1.5, r"'data.min_table_rows' must be an integer"),
])
def test_bad_min_table_rows(rows, needle):
    with pytest.raises(ConfigError, match=needle):
        from_dict({"data": {"min_table_rows": rows}})


def test_unquoted_yaml_dates_are_iso_strings():
    """YAML reads an unquoted ``2009-05-06`` as a date: the config keeps its ISO text, in a
    config file and in ``--set``."""
    import yaml

    from foxhunt_jax.config import load_config

    dates = yaml.safe_load("[2009-05-06, 2011-04-01 12:30:00]")
    cfg = from_dict({"data": {"split_dates": dates, "window": dates}})
    assert cfg.data.split_dates == cfg.data.window == ("2009-05-06", "2011-04-01T12:30:00")
    cfg = load_config("smoke", ["data.split_dates=[2009-05-06,2011-04-01]"])
    assert cfg.data.split_dates == ("2009-05-06", "2011-04-01")


def test_short_window_contributes_nothing():
    # R1 starts late: after its warm-up it has 10 bars before the validation boundary, fewer
    # than an episode needs, so its train segment is empty and its train bars are in no split
    dates = ("2001-09-01", "2002-01-15")
    offset = int((np.datetime64(dates[0]) - np.datetime64("2001-01-01")) // np.timedelta64(1, "D"))
    market = staggered(4, (500, 400), (0, offset - WARMUP - 10))
    tables = build_tables(market, episode_length=L, split_dates=dates)
    assert sum(tables.timestamps[tables.instrument == 1] < np.datetime64(dates[0])) == 10
    a, b = tables.segments["train"][1]
    assert b == a - 1
    assert not np.any(tables.instrument[tables.starts["train"]] == 1)
    assert np.any(tables.instrument[tables.starts["validation"]] == 1)


def test_statistics_and_boundaries_read_only_the_train_window():
    """Prices at or after the validation boundary, in any instrument, move neither the
    normalization statistics nor the boundaries, nor any feature of an earlier bar."""
    rng = np.random.default_rng(5)
    market = staggered(5, (420, 380, 300), (0, 50, 120))
    tables = build_tables(market, episode_length=L)
    for i, ins in enumerate(market.instruments):
        first = int(np.searchsorted(ins.timestamps, tables.split_dates.validation_start))
        new = build_tables(replace_bars(market, i, first, rng), episode_length=L)
        assert new.split_dates == tables.split_dates
        np.testing.assert_array_equal(new.norm_mean, tables.norm_mean)
        np.testing.assert_array_equal(new.norm_std, tables.norm_std)
        earlier = tables.timestamps < tables.split_dates.validation_start
        np.testing.assert_array_equal(new.features[earlier], tables.features[earlier])
    # a change before the boundary does move them (the check above is not vacuous)
    new = build_tables(replace_bars(market, 1, WARMUP + 5, rng, last=WARMUP + 5),
                       episode_length=L)
    assert not np.array_equal(new.norm_mean, tables.norm_mean)

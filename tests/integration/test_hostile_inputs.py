"""Hostile and careless inputs: each gets exit status 2, one ``error:`` line, no traceback.

The commands run in-process through ``foxhunt_jax.cli.main``; the bad files are the eight
classic kinds, files that are not regular files, absurd synthetic sizes, insane prices,
non-finite config values, seeds out of the PRNG's range and bench JSONs of the wrong shape.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import threading
import typing
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from market_files import bad_file, bars_frame, set_cell, write_csv

from foxhunt_jax.cli import main
from foxhunt_jax.config import Config, SyntheticConfig, load_config
from foxhunt_jax.data.checks import JUMP_FACTOR, MAX_PRICE, MIN_PRICE, first_price_problem, \
    require_memory
from foxhunt_jax.data.features import build_tables
from foxhunt_jax.data.loader import load_market, synthetic_memory_bytes
from foxhunt_jax.data.market import MarketData
from foxhunt_jax.data.synthetic import make_synthetic
from foxhunt_jax.errors import ConfigError, DataError, FoxhuntError


def one_error_line(capsys, argv, *needles) -> str:
    """Runs the CLI with ``argv``; asserts exit 2, exactly one ``error:`` line on stderr holding
    every needle, no traceback, nothing on stdout. Returns the line."""
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert code == 2, (code, captured.err)
    assert "Traceback" not in captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert captured.out == ""
    return lines[0]


# ---------------------------------------------------------------------------------------------
# The eight classic bad files, through `data check`


def _swap_dates(frame):
    frame.loc[[29, 30], "Date"] = frame.loc[[30, 29], "Date"].to_numpy()


def _duplicate_date(frame):
    frame.loc[39, "Date"] = frame.loc[38, "Date"]


@pytest.mark.parametrize("kind, make, needles", [
    ("empty file", lambda p: p.write_text(""), ["file is empty"]),
    ("header only", lambda p: p.write_text("Date,Open,High,Low,Close\n"), ["no data rows"]),
    ("binary garbage", lambda p: p.write_bytes(b"\x00\x9f\xfe garbage \x00" * 50), ["binary"]),
    ("wrong columns", lambda p: write_csv(bars_frame().drop(columns=["Low"]), p),
     ["column 'Low'", "missing required column"]),
])
def test_classic_bad_files_whole_file(tmp_path, capsys, kind, make, needles):
    path = tmp_path / "bad.csv"
    make(path)
    one_error_line(capsys, ["data", "check", path], f"error: {path}", *needles)


@pytest.mark.parametrize("kind, edit, needles", [
    ("unparsable date", set_cell(7, "Date", "2001-13-45"),
     ["column 'Date', row 7", "unparseable date '2001-13-45'"]),
    ("non-numeric price", set_cell(12, "Close", "12,5 EUR"),
     ["column 'Close', row 12", "finite positive number", "'12,5 EUR'"]),
    ("duplicated timestamp", _duplicate_date, ["column 'Date', row 40", "duplicate timestamp"]),
    ("unsorted timestamps", _swap_dates, ["column 'Date', row 31", "not sorted"]),
    ("negative price", set_cell(20, "Open", "-3.5"), ["column 'Open', row 20", "-3.5"]),
    ("zero price", set_cell(21, "Low", "0"), ["column 'Low', row 21", "finite positive number"]),
])
def test_classic_bad_files_at_a_row(tmp_path, capsys, kind, edit, needles):
    path = bad_file(tmp_path, edit)
    one_error_line(capsys, ["data", "check", path], f"error: {path}", *needles)


# ---------------------------------------------------------------------------------------------
# Files that are not regular files


def test_fifo_refused_at_once(tmp_path, capsys):
    fifo = tmp_path / "bars.csv"
    os.mkfifo(fifo)
    # A regression would block in open(); the writer below then unblocks it (the file reads as
    # empty and the assertion on the message fails) instead of hanging the suite.
    done = threading.Event()

    def unblock():
        if not done.wait(20):
            with open(fifo, "wb"):
                pass

    guard = threading.Thread(target=unblock, daemon=True)
    guard.start()
    try:
        one_error_line(capsys, ["data", "check", fifo], str(fifo), "is a FIFO")
        one_error_line(capsys, ["train", "--config", fifo, "--out", tmp_path / "run"],
                       str(fifo), "not a regular file")
    finally:
        done.set()
        guard.join()
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("path, needle", [("/dev/zero", "is a character device"),
                                          ("/dev/null", "is a character device")])
def test_device_refused(capsys, path, needle):
    if not os.path.exists(path):
        pytest.skip(f"{path} missing")
    one_error_line(capsys, ["data", "check", path], f"error: {path}: {needle}")


def test_directory_refused(tmp_path, capsys):
    one_error_line(capsys, ["data", "check", tmp_path], f"error: {tmp_path}: is a directory")


# ---------------------------------------------------------------------------------------------
# builtin:synthetic sizes against memory


def test_synthetic_too_large_for_memory_refused_before_allocating(capsys):
    # 10^12 bars need hundreds of terabytes: refused from the estimate, nothing generated
    line = one_error_line(capsys, ["data", "check",
                                   "builtin:synthetic?instruments=1000000&bars=1000000"],
                          "builtin:synthetic", "memory", "data.synthetic.bars",
                          "data.synthetic.instruments")
    assert "GiB" in line


def test_synthetic_memory_limit_is_compared_with_the_estimate():
    cfg = SyntheticConfig(instruments=3, bars=500)
    need = synthetic_memory_bytes(cfg)
    require_memory(need, "x", ("k",), available=need)  # exactly enough passes
    with pytest.raises(ConfigError, match=r"x needs about .* GiB .*; reduce a or b"):
        require_memory(need, "x", ("a", "b"), available=need - 1)


@pytest.mark.parametrize("instruments, bars", [(3, 4000), (40, 600)])
def test_synthetic_memory_estimate_bounds_the_measured_peak(instruments, bars):
    """The estimate is at least the peak traced while generating and building the tables, and
    within a small factor of it (so it does not refuse what fits)."""
    import tracemalloc

    cfg = SyntheticConfig(instruments=instruments, bars=bars)
    tracemalloc.start()
    try:
        build_tables(make_synthetic(cfg), episode_length=10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    estimate = synthetic_memory_bytes(cfg)
    assert peak <= estimate <= 2 * peak, (peak, estimate)


# ---------------------------------------------------------------------------------------------
# Prices beyond a sane bound: the same rule in `data check`, the loader, build_tables and train


def _price_reference(o, h, lo, c):
    """Float64 loop over bars: (index, field) of the first break of the documented rule."""
    for i in range(len(c)):
        for name, x in (("open", o), ("high", h), ("low", lo), ("close", c)):
            v = float(x[i])
            if not (math.isfinite(v) and MIN_PRICE <= v <= MAX_PRICE):
                return i, name
        if i >= 1 and not (1 / JUMP_FACTOR <= float(c[i]) / float(c[i - 1]) <= JUMP_FACTOR):
            return i, "close"
    return None


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 40))
def test_price_rule_matches_reference(data, n):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    arrays = [100 * np.exp(np.cumsum(rng.normal(0, 0.5, n))) for _ in range(4)]
    for _ in range(data.draw(st.integers(0, 3))):
        k, i = data.draw(st.integers(0, 3)), data.draw(st.integers(0, n - 1))
        with np.errstate(over="ignore"):  # a price already at 1e308 overflows to inf: also bad
            arrays[k][i] = data.draw(st.sampled_from(
                [np.inf, -np.inf, np.nan, 0.0, -1.0, 1e308, 2e15, 1e-16, 1e-300, 1e15, 1e-15,
                 arrays[k][i] * 2e4, arrays[k][i] / 2e4, arrays[k][i] * 9e3]))
    problem = first_price_problem(*arrays)
    expected = _price_reference(*arrays)
    assert (None if problem is None else (problem.index, problem.field)) == expected


def test_embedded_datasets_pass_the_price_rule():
    for name in ("us_stocks_daily", "eurusd_hourly"):
        for ins in load_market([f"builtin:{name}"]).instruments:
            assert first_price_problem(ins.open, ins.high, ins.low, ins.close) is None


def _price_file(tmp_path, scale_rows: dict[int, float], everywhere: float | None = None) -> Path:
    frame = bars_frame()
    for col in ("Open", "High", "Low", "Close"):
        if everywhere is not None:
            frame[col] = frame[col] / frame[col] * everywhere
        for row, factor in scale_rows.items():
            frame.loc[row - 1, col] *= factor
    return write_csv(frame, tmp_path / "prices.csv")


@pytest.mark.parametrize("case, rows, everywhere, needles", [
    ("1e308 everywhere", {}, 1e308, ["row 1", "above the largest accepted price"]),
    ("one 1e308 spike", {40: 1e306}, None, ["row 40", "above the largest accepted price"]),
    ("one-bar jump", {55: 1e5}, None, ["column 'Close', row 55", "a factor beyond 10000"]),
    ("tiny prices", {}, 1e-300, ["row 1", "below the smallest accepted price"]),
])
def test_insane_prices_reported_by_data_check_with_instrument_and_row(
        tmp_path, capsys, case, rows, everywhere, needles):
    path = _price_file(tmp_path, rows, everywhere)
    one_error_line(capsys, ["data", "check", path], f"error: {path}", "instrument prices",
                   *needles)


def test_train_refuses_insane_prices_with_the_data_check_line(tmp_path, capsys):
    path = _price_file(tmp_path, {60: 1e5})
    checked = one_error_line(capsys, ["data", "check", path])
    trained = one_error_line(capsys, ["train", "--config", "smoke", "--no-progress", "--data",
                                      path, "--out", tmp_path / "run"])
    assert trained == checked
    assert not (tmp_path / "run").exists()


def test_build_tables_applies_the_rule_to_markets_built_in_memory():
    ins = make_synthetic(SyntheticConfig(instruments=1, bars=400)).instruments[0]
    close = ins.close.copy()
    close[123] *= 1e5  # High/Low no longer enclose it, which only the loader checks
    bad = dataclasses.replace(ins, close=close)
    with pytest.raises(DataError, match=r"instrument SYN0, bar 123 .*factor beyond 10000"):
        build_tables(MarketData((bad,), 86400.0, 252.0), episode_length=10)


def test_synthetic_random_walk_beyond_the_bound_names_its_keys(capsys):
    one_error_line(capsys, ["data", "check", "builtin:synthetic?volatility=3&bars=300"],
                   "instrument SYN0", "data.synthetic.volatility", "data.synthetic.bars")


# ---------------------------------------------------------------------------------------------
# Config values


def _keys_of(kind, cls=Config, prefix=""):
    """(dotted name, None) of every ``kind`` key of the default config, and (name, length) of
    every non-empty tuple of them."""
    hints = typing.get_type_hints(cls)
    default = cls()
    for f in dataclasses.fields(cls):
        tp, name = hints[f.name], prefix + f.name
        if dataclasses.is_dataclass(tp):
            yield from _keys_of(kind, tp, name + ".")
        elif tp is kind:
            yield name, None
        elif typing.get_origin(tp) is tuple and kind in typing.get_args(tp):
            values = getattr(default, f.name)
            if values:
                yield name, len(values)


def _override(key, length, good, bad):
    """``key=bad`` for a scalar key; the tuple of ``length`` with its last item bad otherwise;
    and the key the error names."""
    if length is None:
        return f"{key}={bad}", key
    return f"{key}=[{', '.join([good] * (length - 1) + [bad])}]", f"{key}[{length - 1}]"


FLOAT_KEYS = list(_keys_of(float))
SEED_KEYS = ("train.seed", "data.synthetic.seed", "population.seed")  # their own range
INT_KEYS = [(k, n) for k, n in _keys_of(int) if k not in SEED_KEYS]


@pytest.mark.parametrize("key, length", FLOAT_KEYS, ids=[k for k, _ in FLOAT_KEYS])
@pytest.mark.parametrize("bad", [".inf", "-.inf", ".nan"])
def test_every_float_key_must_be_finite(key, length, bad):
    override, shown = _override(key, length, "0.5", bad)
    with pytest.raises(ConfigError, match=re.escape(f"config key '{shown}' must be a finite")):
        load_config(None, [override])


@pytest.mark.parametrize("key, length", INT_KEYS, ids=[k for k, _ in INT_KEYS])
def test_every_int_key_must_fit_in_int32(key, length):
    override, shown = _override(key, length, "8", str(2**31))
    with pytest.raises(ConfigError, match=re.escape(f"config key '{shown}' must be an integer "
                                                    f"in -2147483647..2147483647")):
        load_config(None, [override])


@pytest.mark.parametrize("override, needle", [
    ("network.v_max=inf", "config key 'network.v_max' must be a finite number"),
    ("train.learning_rate=inf", "config key 'train.learning_rate' must be a finite number"),
    ("env.cost_bps=nan", "config key 'env.cost_bps' must be a finite number"),
    ("train.target_period=1099511627776", "config key 'train.target_period' must be an integer"),
])
def test_config_value_out_of_range_through_train(tmp_path, capsys, override, needle):
    one_error_line(capsys, ["train", "--set", override, "--out", tmp_path / "run"], needle)
    assert not (tmp_path / "run").exists()


def test_number_too_large_for_a_float():
    with pytest.raises(ConfigError, match="train.learning_rate' must be a number"):
        load_config(None, ["train.learning_rate=" + "9" * 400])


@pytest.mark.parametrize("key", list(SEED_KEYS))
@pytest.mark.parametrize("seed", [-1, 2**32, 10**23])
def test_seed_outside_the_prng_range(key, seed):
    with pytest.raises(ConfigError, match=rf"'{key}' must be an integer in 0..4294967295"):
        load_config(None, [f"{key}={seed}"])


def test_seed_range_edges_accepted_and_cli_line(tmp_path, capsys):
    for seed in (0, 2**32 - 1):
        assert load_config(None, [f"train.seed={seed}"]).train.seed == seed
    one_error_line(capsys, ["train", "--set", "train.seed=100000000000000000000000", "--out",
                            tmp_path / "run"], "train.seed", "0..4294967295")
    one_error_line(capsys, ["data", "check", "builtin:synthetic?seed=-1"],
                   "data.synthetic.seed", "0..4294967295")


# ---------------------------------------------------------------------------------------------
# bench --merge inputs


GOOD_META = {"commit": "abc", "date": "2026-12-01", "command": "foxhunt-jax bench"}


@pytest.mark.parametrize("content, needle", [
    ("[1, 2]", "JSON list, not an object"),
    ("{}", "no 'meta' object"),
    (json.dumps({"meta": {"commit": "abc"}, "seed": {}}), "'meta' lacks date, command"),
    (json.dumps({"meta": GOOD_META}), "no section"),
    (json.dumps({"meta": GOOD_META, "train": [1]}), "section 'train' is not an object"),
    ("{not json", "is not valid JSON"),
    (b"\xff\xfe\x00", "is not valid JSON"),
])
def test_bench_merge_bad_json(tmp_path, capsys, content, needle):
    path = tmp_path / "part.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    one_error_line(capsys, ["bench", "--merge", path], "bench --merge", str(path), needle)


def test_bench_merge_missing_or_irregular_file(tmp_path, capsys):
    one_error_line(capsys, ["bench", "--merge", tmp_path / "missing.json"],
                   str(tmp_path / "missing.json"), "no such file")
    one_error_line(capsys, ["bench", "--merge", "{}"], "cannot read {}")
    one_error_line(capsys, ["bench", "--merge", tmp_path], str(tmp_path), "not a regular file")


def test_bench_merge_error_is_a_foxhunt_error(tmp_path):
    from foxhunt_jax.bench.report import check_bench_json

    with pytest.raises(FoxhuntError, match="not a bench result JSON"):
        check_bench_json([], "x.json")
    assert check_bench_json({"meta": GOOD_META, "seed": {}}, "x.json")["seed"] == {}

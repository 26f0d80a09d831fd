"""Market data loading, validation, builtin datasets and the synthetic market."""

from __future__ import annotations

import gzip
import math
import os
from pathlib import Path

import chex
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foxhunt_jax.config import SyntheticConfig
from foxhunt_jax.data.features import SplitDates
from foxhunt_jax.data.market import split_sizes
from foxhunt_jax.data.loader import (
    DEFAULT_SPLITS,
    MIN_BARS,
    WARMUP_BARS,
    load_market,
    min_bars_needed,
    split_counts,
)
from foxhunt_jax.data.synthetic import (
    ar1_log_returns,
    make_synthetic,
    oracle_exposure,
    synthetic_timestamps,
)
from foxhunt_jax.errors import ConfigError, DataError
from market_files import N_GOOD, bad_file, bars_frame, set_cell, write_csv





def load_error(paths, **kw) -> DataError:
    with pytest.raises(DataError) as info:
        load_market([str(p) for p in paths], **kw)
    return info.value


def assert_instrument_matches(ins, frame: pd.DataFrame) -> None:
    np.testing.assert_array_equal(ins.timestamps, frame["Date"].to_numpy().astype("datetime64[ns]"))
    for col in ("Open", "High", "Low", "Close", "Volume"):
        np.testing.assert_array_equal(getattr(ins, col.lower()), frame[col].to_numpy(np.float64))
    for arr in (ins.open, ins.high, ins.low, ins.close, ins.volume):
        chex.assert_type(arr, np.float64)
        chex.assert_shape(arr, (len(frame),))
    assert ins.timestamps.dtype == np.dtype("datetime64[ns]")


# ---------------------------------------------------------------------------------------------
# Good files


def test_csv_round_trip(tmp_path):
    frame = bars_frame()
    market = load_market([str(write_csv(frame, tmp_path / "spy.csv"))])
    (ins,) = market.instruments
    assert ins.name == "spy" and ins.source == str(tmp_path / "spy.csv")
    assert_instrument_matches(ins, frame)
    assert market.bar_seconds == 86400.0
    assert market.bars_per_year == pytest.approx(365.25)


def test_gzip_csv_and_parquet_round_trip(tmp_path):
    frame = bars_frame(seed=1)
    gz = tmp_path / "a.csv.gz"
    with gzip.open(gz, "wt") as f:
        frame.assign(Date=frame["Date"].dt.strftime("%Y-%m-%d")).to_csv(f, index=False)
    pq = tmp_path / "b.parquet"
    frame.to_parquet(pq)
    market = load_market([str(gz), str(pq)])
    assert [i.name for i in market.instruments] == ["a", "b"]
    for ins in market.instruments:
        assert_instrument_matches(ins, frame)


def test_parquet_timezone_aware_converted_to_utc(tmp_path):
    frame = bars_frame(freq="h")
    frame["Date"] = frame["Date"].dt.tz_localize("Europe/Berlin")
    frame.to_parquet(tmp_path / "x.parquet")
    (ins,) = load_market([str(tmp_path / "x.parquet")]).instruments
    expected = frame["Date"].dt.tz_convert("UTC").dt.tz_localize(None).to_numpy()
    np.testing.assert_array_equal(ins.timestamps, expected.astype("datetime64[ns]"))


def test_volume_optional_and_blank_lines_ignored(tmp_path):
    frame = bars_frame().drop(columns="Volume")
    path = write_csv(frame, tmp_path / "novol.csv")
    lines = path.read_text().splitlines()
    lines.insert(5, "")  # a blank line between data rows 4 and 5
    path.write_text("\n".join(lines) + "\n")
    (ins,) = load_market([str(path)]).instruments
    np.testing.assert_array_equal(ins.volume, np.zeros(len(frame)))
    np.testing.assert_array_equal(ins.close, frame["Close"].to_numpy())


def test_blank_line_counts_as_row(tmp_path):
    frame = bars_frame()
    path = write_csv(frame, tmp_path / "blank.csv")
    lines = path.read_text().splitlines()
    lines.insert(3, "")  # data row 3 is blank, the frame's 10th bar is data row 11
    lines[11] = lines[11].replace(lines[11].split(",")[4], "-3", 1)
    path.write_text("\n".join(lines) + "\n")
    err = load_error([path])
    assert err.row == 11 and err.column == "Close"


def test_several_files_keep_order_and_sources(tmp_path):
    paths = [write_csv(bars_frame(seed=s), tmp_path / f"f{s}.csv") for s in (3, 1, 2)]
    market = load_market([str(p) for p in paths])
    assert [i.name for i in market.instruments] == ["f3", "f1", "f2"]
    assert [i.source for i in market.instruments] == [str(p) for p in paths]


def test_duplicate_instrument_across_files(tmp_path):
    a = write_csv(bars_frame(), tmp_path / "x.csv")
    (tmp_path / "sub").mkdir()
    b = write_csv(bars_frame(seed=2), tmp_path / "sub" / "x.csv")
    err = load_error([a, b])
    assert "instrument 'x'" in str(err) and str(b) in str(err) and str(a) in str(err)


@pytest.mark.parametrize("ticker_col", ["Ticker", "symbol", "INSTRUMENT"])
def test_ticker_column_splits_instruments(tmp_path, ticker_col):
    a, b = bars_frame(seed=1), bars_frame(seed=2, n=N_GOOD + 7)
    both = pd.concat([b.assign(**{ticker_col: "BBB"}), a.assign(**{ticker_col: "AAA"})])
    both = both.sort_values("Date", kind="stable")  # interleaved by time, BBB first on a tie
    market = load_market([str(write_csv(both, tmp_path / "multi.csv"))])
    assert [i.name for i in market.instruments] == ["BBB", "AAA"]
    assert_instrument_matches(market.instruments[0], b)
    assert_instrument_matches(market.instruments[1], a)


def test_ticker_text_kept_verbatim_and_semicolons(tmp_path):
    # "NA" is a ticker, not a missing value; "007" keeps its zeros; ';' separators are sniffed.
    both = pd.concat([bars_frame(seed=1).assign(Ticker="NA"),
                      bars_frame(seed=2).assign(Ticker="007")])
    both["Date"] = both["Date"].dt.strftime("%Y-%m-%d")
    both.to_csv(tmp_path / "semi.csv", index=False, sep=";")
    market = load_market([str(tmp_path / "semi.csv")])
    assert [i.name for i in market.instruments] == ["NA", "007"]
    assert_instrument_matches(market.instruments[0], bars_frame(seed=1))


def test_missing_ticker_reported(tmp_path):
    both = pd.concat([bars_frame(seed=1).assign(Ticker="A"), bars_frame(seed=2).assign(Ticker="B")])
    both = both.reset_index(drop=True)
    both.loc[N_GOOD + 4, "Ticker"] = ""
    err = load_error([write_csv(both, tmp_path / "t.csv")])
    assert (err.column, err.row) == ("Ticker", N_GOOD + 5) and "instrument name" in str(err)


def test_ticker_rows_in_errors_are_file_rows(tmp_path):
    a, b = bars_frame(seed=1), bars_frame(seed=2)
    both = pd.concat([a.assign(Symbol="A"), b.assign(Symbol="B")]).reset_index(drop=True)
    # Swap two of B's bars: B's first bar is file row len(a) + 1.
    i, j = len(a) + 10, len(a) + 11
    both.iloc[[i, j]] = both.iloc[[j, i]].to_numpy()
    err = load_error([write_csv(both, tmp_path / "m.csv")])
    assert err.row == j + 1 and err.column == "Date" and "instrument B" in str(err)


@pytest.mark.parametrize("names", [
    ("Date", "Open", "High", "Low", "Close", "Volume", "Adj Close"),
    ("datetime", "OPEN", "high", "LOW", "close", "VOLUME", "Adj_Close"),
    ("Timestamp", "open", "High", "low", "Close", "volume", "adjclose"),
    ("TIME", "Open", "HIGH", "Low", "CLOSE", "Volume", "adj close"),
])
def test_column_aliases(tmp_path, names):
    frame = bars_frame(adj=True)
    renamed = frame.rename(columns=dict(zip(
        ("Date", "Open", "High", "Low", "Close", "Volume", "Adj Close"), names)))
    renamed[names[0]] = renamed[names[0]].dt.strftime("%Y-%m-%d")
    renamed.to_csv(tmp_path / "al.csv", index=False)
    (ins,) = load_market([str(tmp_path / "al.csv")]).instruments
    factor = frame["Adj Close"].to_numpy() / frame["Close"].to_numpy()
    np.testing.assert_allclose(ins.close, frame["Adj Close"].to_numpy(), rtol=1e-15)
    np.testing.assert_allclose(ins.open, frame["Open"].to_numpy() * factor, rtol=1e-15)
    np.testing.assert_allclose(ins.high, frame["High"].to_numpy() * factor, rtol=1e-15)
    np.testing.assert_allclose(ins.low, frame["Low"].to_numpy() * factor, rtol=1e-15)


def test_two_time_columns_rejected(tmp_path):
    frame = bars_frame()
    frame["Time"] = "00:00"
    err = load_error([write_csv(frame, tmp_path / "t.csv")])
    assert "'Date'" in str(err) and "'Time'" in str(err)


@pytest.mark.parametrize("fmt", [
    "%Y-%m-%d", "%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M", "%m/%d/%Y", "%m/%d/%Y %H:%M",
    "%d.%m.%Y %H:%M:%S.000", "%d.%m.%Y",
])
def test_date_formats(tmp_path, fmt):
    frame = bars_frame(freq="7h" if "%H" in fmt else "D", start="2003-01-05")
    (ins,) = load_market([str(write_csv(frame, tmp_path / "d.csv", date_format=fmt))]).instruments
    np.testing.assert_array_equal(ins.timestamps, frame["Date"].to_numpy().astype("datetime64[ns]"))


def test_iso_with_offsets_converted_to_utc(tmp_path):
    frame = bars_frame(freq="h")
    stamps = frame["Date"].dt.tz_localize("America/New_York", ambiguous="NaT",
                                          nonexistent="NaT")
    frame = frame[stamps.notna().to_numpy()].reset_index(drop=True)
    stamps = stamps.dropna().reset_index(drop=True)
    text = frame.assign(Date=stamps.map(lambda t: t.isoformat()))
    (ins,) = load_market([str(write_csv(text, tmp_path / "tz.csv", None))]).instruments
    utc = stamps.dt.tz_convert("UTC").dt.tz_localize(None).to_numpy().astype("datetime64[ns]")
    np.testing.assert_array_equal(ins.timestamps, utc)


def test_day_month_never_mixed(tmp_path):
    # 01/02 .. 12/02 would parse as M/D; a later 13/02 is a day-first date: reject, do not mix.
    frame = bars_frame(start="2001-01-02", freq="D")
    text = frame["Date"].dt.strftime("%m/%d/%Y").to_numpy().copy()
    text[40] = "13/02/2001"
    err = load_error([write_csv(frame.assign(Date=text), tmp_path / "mix.csv", None)])
    assert err.row == 41 and err.column == "Date" and "13/02/2001" in str(err)


def test_sort_option_sorts(tmp_path):
    frame = bars_frame()
    shuffled = frame.sample(frac=1.0, random_state=3)
    path = write_csv(shuffled, tmp_path / "shuf.csv")
    load_error([path])
    (ins,) = load_market([str(path)], sort=True).instruments
    assert_instrument_matches(ins, frame)


# ---------------------------------------------------------------------------------------------
# Bad files: each kind names file, column and row




def test_missing_column(tmp_path):
    err = load_error([bad_file(tmp_path, lambda f: f.pop("Low"))])
    assert err.column == "Low" and err.row is None
    assert str(err).startswith(str(tmp_path / "bad.csv")) and "missing required column" in str(err)


def test_missing_time_column(tmp_path):
    def edit(f):
        f.insert(0, "Day", f.pop("Date"))
    err = load_error([bad_file(tmp_path, edit)])
    assert err.column == "Date" and "timestamp" in str(err)


@pytest.mark.parametrize("value", ["2001-13-45", "yesterday", ""])
def test_unparseable_date(tmp_path, value):
    err = load_error([bad_file(tmp_path, set_cell(7, "Date", value))])
    assert (err.column, err.row) == ("Date", 7)
    assert str(tmp_path / "bad.csv") in str(err) and "row 7" in str(err)


@pytest.mark.parametrize("col,value,row", [
    ("Close", "", 10), ("Open", "nan", 3), ("High", "inf", 33), ("Low", "abc", 50),
    ("Close", "-1.5", 12), ("Open", "0", 99),
])
def test_bad_price(tmp_path, col, value, row):
    err = load_error([bad_file(tmp_path, set_cell(row, col, value))])
    assert (err.column, err.row) == (col, row)
    assert f"column '{col}'" in str(err) and f"row {row}" in str(err)
    assert "finite positive" in str(err)


def test_bad_volume(tmp_path):
    err = load_error([bad_file(tmp_path, set_cell(8, "Volume", "-5"))])
    assert (err.column, err.row) == ("Volume", 8)


def test_earliest_bad_row_over_columns(tmp_path):
    def edit(f):
        set_cell(30, "Open", "-1")(f)
        set_cell(20, "Close", "nan")(f)
    err = load_error([bad_file(tmp_path, edit)])
    assert (err.column, err.row) == ("Close", 20)


def test_high_below_low(tmp_path):
    def edit(f):
        f.loc[19, "High"], f.loc[19, "Low"] = f.loc[19, "Low"], f.loc[19, "High"]
    err = load_error([bad_file(tmp_path, edit)])
    assert (err.column, err.row) == ("High", 20) and "below Low" in str(err)


def test_high_not_enclosing(tmp_path):
    def edit(f):
        top = max(f.loc[20, "Open"], f.loc[20, "Close"])
        f.loc[20, "High"] = max(f.loc[20, "Low"], 0.999 * top)
    err = load_error([bad_file(tmp_path, edit)])
    assert (err.column, err.row) == ("High", 21) and "max(Open, Close)" in str(err)


def test_low_not_enclosing(tmp_path):
    def edit(f):
        f.loc[21, "Low"] = 1.001 * min(f.loc[21, "Open"], f.loc[21, "Close"])
        f.loc[21, "High"] = max(f.loc[21, "High"], f.loc[21, "Low"])
    err = load_error([bad_file(tmp_path, edit)])
    assert (err.column, err.row) == ("Low", 22) and "min(Open, Close)" in str(err)


def test_rounding_tolerated(tmp_path):
    def edit(f):
        top = max(f.loc[5, "Open"], f.loc[5, "Close"])
        f.loc[5, "High"] = top * (1 - 1e-12)
        f.loc[6, "Low"] = min(f.loc[6, "Open"], f.loc[6, "Close"]) * (1 + 1e-12)
    (ins,) = load_market([str(bad_file(tmp_path, edit))]).instruments
    assert len(ins) == N_GOOD


def test_unsorted(tmp_path):
    def edit(f):
        f.loc[[29, 30], "Date"] = f.loc[[30, 29], "Date"].to_numpy()
    err = load_error([bad_file(tmp_path, edit)])
    assert (err.column, err.row) == ("Date", 31)
    assert "not sorted" in str(err) and "--sort" in str(err)


def test_duplicate_timestamp_even_with_sort(tmp_path):
    def edit(f):
        f.loc[39, "Date"] = f.loc[38, "Date"]
    path = bad_file(tmp_path, edit)
    for sort in (False, True):
        err = load_error([path], sort=sort)
        assert (err.column, err.row) == ("Date", 40) and "same as row 39" in str(err)


def test_too_few_bars(tmp_path):
    frame = bars_frame(n=MIN_BARS - 1)
    err = load_error([write_csv(frame, tmp_path / "short.csv")])
    assert "too few bars" in str(err) and str(MIN_BARS) in str(err)
    (ins,) = load_market([str(write_csv(bars_frame(n=MIN_BARS), tmp_path / "ok.csv"))]).instruments
    assert len(ins) == MIN_BARS
    # the min_bars argument overrides the default
    (short,) = load_market([str(tmp_path / "short.csv")], min_bars=10).instruments
    assert len(short) == MIN_BARS - 1


def test_short_instrument_in_multi_file_skipped_with_warning(tmp_path, capsys):
    both = pd.concat([bars_frame().assign(Ticker="LONG"),
                      bars_frame(n=MIN_BARS - 5).assign(Ticker="TINY")])
    path = write_csv(both, tmp_path / "two.csv")
    warnings: list[str] = []
    market = load_market([str(path)], on_warning=warnings.append)
    assert [i.name for i in market.instruments] == ["LONG"]
    assert warnings == [f"{path}: instrument TINY has {MIN_BARS - 5} bars, fewer than "
                        f"{MIN_BARS} needed; skipped"]
    load_market([str(path)])  # default: printed on stderr
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert err_lines == ["warning: " + warnings[0]]
    all_short = write_csv(pd.concat([bars_frame(n=30).assign(Ticker="A"),
                                     bars_frame(n=40).assign(Ticker="B")]), tmp_path / "s.csv")
    err = load_error([all_short], on_warning=warnings.append)
    assert "too few bars" in str(err) and "instrument B has 40" in str(err)


def test_min_bars_rule():
    n = min_bars_needed()
    assert n == MIN_BARS
    # one instrument alone fits a shortest episode in each split of the default fractions
    assert min(split_sizes(n - WARMUP_BARS, DEFAULT_SPLITS)) >= 2
    assert min(split_sizes(n - 1 - WARMUP_BARS, DEFAULT_SPLITS)) < 2
    # the warm-up bars feed the features; the rest are cut at the calendar boundaries
    stamps = np.arange(3270).astype("datetime64[D]").astype("datetime64[ns]")
    dates = SplitDates(stamps[WARMUP_BARS + 2244], stamps[WARMUP_BARS + 2725], "test")
    assert split_counts(stamps, dates) == (2244, 481, 481)
    assert split_counts(stamps[2000:], dates) == (244, 481, 481)  # its warm-up ends later
    assert sum(split_counts(stamps, dates)) == 3270 - WARMUP_BARS


def test_unreadable_files(tmp_path):
    err = load_error([tmp_path / "nope.csv"])
    assert "file not found" in str(err) and str(tmp_path / "nope.csv") in str(err)
    err = load_error([tmp_path])
    assert "directory" in str(err)
    (tmp_path / "junk.parquet").write_bytes(os.urandom(300))
    assert "not a Parquet file" in str(load_error([tmp_path / "junk.parquet"]))
    # A Parquet signature with a broken body: pyarrow's error is wrapped.
    (tmp_path / "broken.parquet").write_bytes(b"PAR1" + os.urandom(200) + b"PAR1")
    assert "cannot read Parquet" in str(load_error([tmp_path / "broken.parquet"]))
    (tmp_path / "bin.csv").write_bytes(b"\x00\x01\x02garbage\x00" * 20)
    assert "binary" in str(load_error([tmp_path / "bin.csv"]))


def test_corrupt_gzip(tmp_path):
    frame = bars_frame()
    good = gzip.compress(frame.to_csv(index=False).encode())
    (tmp_path / "trunc.csv.gz").write_bytes(good[: len(good) // 2])
    err = load_error([tmp_path / "trunc.csv.gz"])
    assert "gzip" in str(err) and str(tmp_path / "trunc.csv.gz") in str(err)
    (tmp_path / "noise.csv.gz").write_bytes(b"\x1f\x8b" + os.urandom(100))
    assert "gzip" in str(load_error([tmp_path / "noise.csv.gz"]))


def test_permission_denied(tmp_path, monkeypatch):
    """An OSError on open (as for a file without read permission; root would not get one)."""
    import foxhunt_jax.data.loader as loader

    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    path = write_csv(bars_frame(), tmp_path / "locked.csv")
    monkeypatch.setattr(loader, "open", denied, raising=False)
    err = load_error([path])
    assert "cannot open file: Permission denied" in str(err) and str(path) in str(err)


def test_empty_files(tmp_path):
    (tmp_path / "empty.csv").write_text("")
    assert "empty" in str(load_error([tmp_path / "empty.csv"]))
    (tmp_path / "blank.csv").write_text("\n\n")
    assert "empty" in str(load_error([tmp_path / "blank.csv"]))
    (tmp_path / "header.csv").write_text("Date,Open,High,Low,Close\n")
    assert "no data rows" in str(load_error([tmp_path / "header.csv"]))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(MIN_BARS, MIN_BARS + 40), data=st.data(),
       kind=st.sampled_from(["nan", "negative", "high<low", "date", "dup"]))
def test_random_defect_reported_at_its_row(tmp_path_factory, n, data, kind):
    """Any single defect in a random valid file is reported at exactly its row."""
    row = data.draw(st.integers(2, n))  # 1-based; >= 2 so a duplicate has a predecessor
    frame = bars_frame(n=n, seed=row)
    text = frame.assign(Date=frame["Date"].dt.strftime("%Y-%m-%d")).astype(object)
    i = row - 1
    col = {"nan": "Close", "negative": "Open", "high<low": "High", "date": "Date",
           "dup": "Date"}[kind]
    if kind == "nan":
        text.loc[i, "Close"] = "nan"
    elif kind == "negative":
        text.loc[i, "Open"] = -text.loc[i, "Open"]
    elif kind == "high<low":
        text.loc[i, "High"] = text.loc[i, "Low"] * 0.99
    elif kind == "date":
        text.loc[i, "Date"] = "31.31.2001"
    else:
        text.loc[i, "Date"] = text.loc[i - 1, "Date"]
    path = tmp_path_factory.mktemp("h") / "f.csv"
    text.to_csv(path, index=False)
    err = load_error([path])
    assert (err.column, err.row, err.path) == (col, row, str(path))


# ---------------------------------------------------------------------------------------------
# Builtin datasets


def test_builtin_us_stocks():
    market = load_market(["builtin:us_stocks_daily"])
    counts = {i.name: len(i) for i in market.instruments}
    assert counts == {"AAPL": 3270, "IBM": 3270, "MSFT": 3270, "GOOG": 2148, "FB": 196}
    assert all(i.source == "builtin:us_stocks_daily" for i in market.instruments)
    assert market.bar_seconds == 86400.0
    assert 240 < market.bars_per_year < 260
    aapl = next(i for i in market.instruments if i.name == "AAPL")
    raw = pd.read_csv(Path(__file__).resolve().parents[2] / "foxhunt_jax" / "data" / "builtin"
                      / "us_stocks_daily.csv.gz")
    raw = raw[raw["Ticker"] == "AAPL"].reset_index(drop=True)
    np.testing.assert_allclose(aapl.close, raw["Adj Close"].to_numpy(), rtol=1e-15)
    for day in ("2000-06-21", "2005-02-28"):  # AAPL's 2:1 splits
        k = int(np.flatnonzero(aapl.timestamps == np.datetime64(day))[0])
        assert raw["Close"][k] / raw["Close"][k - 1] < 0.6  # the split, unadjusted
        assert abs(math.log(aapl.close[k] / aapl.close[k - 1])) < 0.1  # gone after adjustment
        factor = raw["Adj Close"][k] / raw["Close"][k]
        for col in ("Open", "High", "Low"):
            assert getattr(aapl, col.lower())[k] == pytest.approx(raw[col][k] * factor, rel=1e-15)


def test_builtin_eurusd():
    market = load_market(["builtin:eurusd_hourly"])
    (ins,) = market.instruments
    assert (ins.name, len(ins)) == ("eurusd_hourly", 6225)
    assert ins.timestamps[0] == np.datetime64("2017-01-01T22:00")
    assert ins.timestamps[-1] == np.datetime64("2017-12-29T21:00")
    assert market.bar_seconds == 3600.0
    assert 6000 < market.bars_per_year < 6400


def test_builtin_synthetic_with_parameters():
    market = load_market(["builtin:synthetic?instruments=2&bars=500&seed=3&signal_strength=0.2"],
                         synthetic=SyntheticConfig(instruments=5, volatility=0.02))
    expected = make_synthetic(SyntheticConfig(instruments=2, bars=500, seed=3,
                                              signal_strength=0.2, volatility=0.02))
    assert len(market.instruments) == 2
    for got, want in zip(market.instruments, expected.instruments):
        np.testing.assert_array_equal(got.close, want.close)
    assert len(load_market(["builtin:synthetic"]).instruments) == SyntheticConfig().instruments


@pytest.mark.parametrize("source,needle", [
    ("builtin:nasdaq", "nasdaq"),
    ("builtin:synthetic?colour=red", "colour"),
    ("builtin:synthetic?bars=ten", "bars"),
    ("builtin:synthetic?bars=50", "bars"),
    ("builtin:synthetic?seed", "seed"),
    ("builtin:us_stocks_daily?bars=3", "takes no parameters"),
])
def test_builtin_bad_names_and_parameters(source, needle):
    with pytest.raises(ConfigError, match=needle):
        load_market([source])


def test_no_sources():
    with pytest.raises(ConfigError):
        load_market([])


# ---------------------------------------------------------------------------------------------
# Synthetic market


def test_ar1_matches_loop_reference():
    rng = np.random.default_rng(7)
    for n in (1, 3, 256, 700):
        eps = rng.standard_normal((2, n))
        rho, vol = float(rng.uniform(0, 0.95)), float(rng.uniform(0.001, 0.05))
        ref = np.empty_like(eps)
        ref[:, 0] = vol * eps[:, 0]
        for t in range(1, n):
            ref[:, t] = rho * ref[:, t - 1] + math.sqrt(1 - rho * rho) * vol * eps[:, t]
        np.testing.assert_allclose(ar1_log_returns(eps, rho, vol), ref, rtol=1e-12, atol=1e-17)


def test_synthetic_deterministic_and_seeded():
    cfg = SyntheticConfig(instruments=3, bars=400, seed=11)
    a, b = make_synthetic(cfg), make_synthetic(cfg)
    c = make_synthetic(SyntheticConfig(instruments=3, bars=400, seed=12))
    for x, y, z in zip(a.instruments, b.instruments, c.instruments):
        for field in ("open", "high", "low", "close", "volume", "timestamps"):
            np.testing.assert_array_equal(getattr(x, field), getattr(y, field))
        assert not np.array_equal(x.close, z.close)
    assert [i.name for i in a.instruments] == ["SYN0", "SYN1", "SYN2"]


def test_synthetic_bars_are_valid_and_shaped(tmp_path):
    cfg = SyntheticConfig(instruments=2, bars=600, seed=5, volatility=0.02)
    market = make_synthetic(cfg)
    for ins in market.instruments:
        for arr in (ins.open, ins.high, ins.low, ins.close, ins.volume):
            chex.assert_shape(arr, (cfg.bars,))
            chex.assert_type(arr, np.float64)
        assert ins.timestamps.dtype == np.dtype("datetime64[ns]")
        assert np.all(ins.high >= np.maximum(ins.open, ins.close))
        assert np.all(ins.low <= np.minimum(ins.open, ins.close))
        assert np.all(ins.low > 0) and np.all(ins.volume > 0)
        gap = np.log(ins.open[1:] / ins.close[:-1])  # no gap beyond a tiny noise
        assert np.max(np.abs(gap)) < 0.05 * cfg.volatility * 6
    # The loader accepts them unchanged.
    frames = [pd.DataFrame({"Date": i.timestamps, "Open": i.open, "High": i.high, "Low": i.low,
                            "Close": i.close, "Volume": i.volume, "Ticker": i.name})
              for i in market.instruments]
    pd.concat(frames).to_parquet(tmp_path / "syn.parquet")
    loaded = load_market([str(tmp_path / "syn.parquet")])
    for got, want in zip(loaded.instruments, market.instruments):
        np.testing.assert_array_equal(got.close, want.close)
        np.testing.assert_array_equal(got.timestamps, want.timestamps)
    assert market.bar_seconds == 86400.0


def test_synthetic_timestamps():
    ts = synthetic_timestamps(30)
    assert ts[0] == np.datetime64("2000-01-03")
    assert np.all(np.is_busday(ts.astype("datetime64[D]")))
    assert np.all(np.diff(ts) > np.timedelta64(0, "ns"))
    long = synthetic_timestamps(80_000)  # too long for business days before 2262: hourly
    assert long.dtype == np.dtype("datetime64[ns]")
    assert np.all(np.diff(long) == np.timedelta64(1, "h"))


@pytest.mark.parametrize("rho", [0.0, 0.3, 0.6])
def test_planted_signal_strength(rho):
    """200k bars: lag-1 autocorrelation is rho, and the oracle earns rho * vol * sqrt(2/pi)."""
    vol = 0.01
    market = make_synthetic(SyntheticConfig(instruments=4, bars=50_000, signal_strength=rho,
                                            volatility=vol, seed=21))
    r = np.stack([np.diff(np.log(i.close)) for i in market.instruments])  # [4, 49_999]
    prev, nxt = r[:, :-1].ravel(), r[:, 1:].ravel()
    autocorr = np.corrcoef(prev, nxt)[0, 1]
    assert abs(autocorr - rho) < 0.01
    assert np.std(r) == pytest.approx(vol, rel=0.02)
    pnl = oracle_exposure(r[:, :-1]) * r[:, 1:]  # [4, 49_998]
    batches = pnl[:, : 49_900].reshape(4 * 100, -1).mean(axis=1)  # batch means: robust SE
    se = batches.std(ddof=1) / math.sqrt(batches.size)
    expected = rho * vol * math.sqrt(2 / math.pi)
    assert abs(pnl[:, : 49_900].mean() - expected) < 4 * se
    if rho > 0:
        assert pnl.mean() > 0 and expected > 10 * se


def test_oracle_exposure_numpy_and_jax():
    import jax
    import jax.numpy as jnp

    x = np.array([[0.5, -0.2, 0.0], [-1e-9, 3.0, -0.0]])
    want = np.array([[1.0, -1.0, 0.0], [-1.0, 1.0, 0.0]])
    got = oracle_exposure(x)
    assert isinstance(got, np.ndarray)
    chex.assert_shape(got, x.shape)
    chex.assert_type(got, np.float64)
    np.testing.assert_array_equal(got, want)
    xj = jnp.asarray(x, dtype=jnp.float32)
    gj = jax.jit(oracle_exposure)(xj)
    assert isinstance(gj, jax.Array)
    chex.assert_shape(gj, x.shape)
    chex.assert_type(gj, jnp.float32)
    np.testing.assert_array_equal(np.asarray(gj), want)

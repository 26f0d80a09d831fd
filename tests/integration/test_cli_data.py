"""`foxhunt-jax data check` and the CLI's error contract."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from foxhunt_jax.cli import COMMANDS, human_duration, main
from foxhunt_jax.data.features import split_boundaries
from foxhunt_jax.data.loader import MIN_BARS, load_market, split_counts

REPO = Path(__file__).resolve().parents[2]


def table_rows(out: str) -> dict[str, list[str]]:
    """Plain-text table -> {instrument: cells} (cells split on runs of 2+ spaces)."""
    import re

    rows = {}
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == 9 and cells[0] != "instrument" and not cells[0].startswith("-"):
            rows[cells[0]] = cells
    return rows


def write_bars(path: Path, n: int, freq: str, start: str = "2020-01-06 09:30") -> Path:
    rng = np.random.default_rng(n)
    close = 10 * np.exp(np.cumsum(0.001 * rng.standard_normal(n)))
    frame = pd.DataFrame({"Timestamp": pd.date_range(start, periods=n, freq=freq).strftime(
        "%Y-%m-%d %H:%M:%S"), "Open": close, "High": close * 1.001, "Low": close * 0.999,
        "Close": close})
    frame.to_csv(path, index=False)
    return path


def test_data_check_us_stocks(capsys):
    assert main(["data", "check", "builtin:us_stocks_daily"]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert set(rows) == {"AAPL", "IBM", "MSFT", "GOOG", "FB"}
    market = load_market(["builtin:us_stocks_daily"])
    dates = split_boundaries(market, (0.7, 0.15, 0.15))
    for ins in market.instruments:
        cells = rows[ins.name]
        assert cells[1] == "builtin:us_stocks_daily" and cells[2] == str(len(ins))
        assert cells[5] == "1 day"
        assert tuple(int(c.rstrip("*")) for c in cells[6:9]) == split_counts(ins.timestamps,
                                                                            dates)
    assert rows["AAPL"][3:5] == ["2000-03-01", "2013-03-01"]
    assert rows["GOOG"][3] == "2004-08-19"
    # FB starts in 2012: no bar before the validation window, too few in it (a 100-step
    # episode needs 101), all its other bars in the test window
    assert rows["FB"][6:9] == ["0*", "0*", "132"]
    assert "5 instruments, 12154 bars" in out
    assert ("train before 2009-05-06; validation from 2009-05-06 to before 2011-04-01; test "
            "from 2011-04-01") in out


def test_data_check_split_dates(capsys):
    assert main(["data", "check", "builtin:us_stocks_daily", "--split-dates",
                 "2010-01-01,2012-06-01", "--episode-length", "150"]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert rows["AAPL"][6:9] == ["2411", "608", "187"]
    assert rows["FB"][6:9] == ["0*", "0*", "132*"]  # 132 < 151
    assert "test from 2012-06-01 (data.split_dates)" in out
    assert main(["data", "check", "builtin:us_stocks_daily", "--split-dates",
                 "2012-01-01,2010-01-01"]) == 2
    assert "data.split_dates" in capsys.readouterr().err


def test_data_check_eurusd_and_synthetic_with_splits(capsys):
    code = main(["data", "check", "builtin:eurusd_hourly",
                 "builtin:synthetic?instruments=2&bars=300&seed=1", "--splits", "0.5,0.25,0.25"])
    assert code == 0
    rows = table_rows(capsys.readouterr().out)
    fx = rows["eurusd_hourly"]
    assert fx[2:6] == ["6225", "2017-01-01 22:00:00", "2017-12-29 21:00:00", "1 hour"]
    # one calendar boundary for all: 6161 hourly 2017 times after warm-up and 236 daily ones of
    # 2000-2001 (both SYN instruments on the same days) are 6397 distinct; train takes the first
    # round(6397 * 0.5) = 3198: the 236 daily ones and 2962 hourly ones
    assert fx[6:9] == ["2962", "1600", "1599"]
    assert set(rows) == {"eurusd_hourly", "SYN0", "SYN1"}
    # 300 bars - 64 warm-up = 236 daily bars, all before the validation window
    assert rows["SYN1"][2:] == ["300", "2000-01-03", "2001-02-23", "1 day", "236", "0*", "0*"]


def test_data_check_file_frequency_and_sort(tmp_path, capsys):
    path = write_bars(tmp_path / "es.csv", MIN_BARS + 10, "15min")
    lines = path.read_text().splitlines()
    lines[3], lines[4] = lines[4], lines[3]
    path.write_text("\n".join(lines) + "\n")
    assert main(["data", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}, column 'Timestamp', row 4:")
    assert main(["data", "check", "--sort", str(path)]) == 0
    cells = table_rows(capsys.readouterr().out)["es"]
    assert cells[2] == str(MIN_BARS + 10) and cells[5] == "15 min"
    assert cells[3] == "2020-01-06 09:30:00"


def test_data_check_rich_table_on_terminal(capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert main(["data", "check", "builtin:synthetic?instruments=3&bars=250"]) == 0
    out = capsys.readouterr().out
    for text in ("SYN0", "SYN2", "250", "130", "1 day"):  # 250 - 64 = 186 usable, 130 train
        assert text in out


@pytest.mark.parametrize("argv,needle", [
    (["data", "check", "missing_file.csv"], "missing_file.csv: file not found"),
    (["data", "check", "builtin:nope"], "unknown builtin dataset 'nope'"),
    (["data", "check", "builtin:synthetic", "--splits", "0.5,0.6,0.1"], "data.splits"),
    (["data", "check", "builtin:synthetic", "--splits", "a,b,c"], "--splits"),
])
def test_errors_in_process(capsys, argv, needle):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0]
    assert captured.out == ""


def test_usage_errors_exit_2(capsys):
    assert main(["data", "check"]) == 2  # argparse: PATH required
    assert main(["data"]) == 2  # no subcommand: help on stderr
    assert main(["frobnicate"]) == 2
    assert main(["--help"]) == 0
    capsys.readouterr()


def test_registry_has_data_check():
    paths = [c.path for c in COMMANDS]
    assert ("data", "check") in paths and len(set(paths)) == len(paths)


@pytest.mark.parametrize("seconds,text", [
    (86400, "1 day"), (3 * 86400, "3 days"), (3600, "1 hour"), (7200, "2 hours"),
    (900, "15 min"), (60, "1 min"), (604800, "1 week"), (7.5, "7.5 s"), (90, "90 s"),
])
def test_human_duration(seconds, text):
    assert human_duration(seconds) == text


def test_subprocess_bad_file_one_error_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("Date,Open,High,Low,Close\n2001-01-02,1,2,0.5,1\n2001-01-03,1,0.4,0.5,1\n")
    proc = subprocess.run([sys.executable, "-m", "foxhunt_jax", "data", "check", str(bad)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0] == f"error: {bad}, column 'High', row 2: High 0.4 is below Low 0.5"

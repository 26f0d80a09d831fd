"""Discoverability and output: config meanings, `config show/keys`, help defaults, resume errors
that name keys, callbacks and writers of the library, the compile cache, evaluate's trade log,
and the README's command-line block run end to end."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from foxhunt_jax import api
from foxhunt_jax.cli import COMMANDS, main
from foxhunt_jax.config import (Config, EnvConfig, keys, load_config, show_yaml, to_dict)
from foxhunt_jax.data.features import MarketTables
from foxhunt_jax.env import trading
from foxhunt_jax.errors import ConfigError
from foxhunt_jax.training.rundir import flatten, read_metrics
from foxhunt_jax.training.trades import walk_trades

ROOT = Path(__file__).resolve().parents[2]
# tiny sizes (the suite's shared tiny network), for commands that start from another config
TINY_SIZES = ["env.episode_length=8", "network.trunk=[16]", "network.head=16",
               "network.atoms=5", "curiosity.hidden=8", "curiosity.embed=4",
               "replay.capacity=4096", "train.num_episodes=16", "train.train_steps=2",
               "train.batch_size=32", "train.validation_windows=16",
               "train.epsilon_decay_epochs=2", "eval.random_policies=8"]


# ---------------------------------------------------------------------------------------------
# Config: meanings, show, keys


def test_every_key_has_a_one_line_meaning_and_show_reads_back_as_the_config():
    listed = [k.key for k in keys()]
    assert listed == [k.replace("/", ".") for k in flatten(to_dict(Config()))]
    for k in keys():
        assert k.meaning and "\n" not in k.meaning and len(k.meaning) < 120, k
    cfg = load_config("smoke", ["env.take_profit=[]", "train.epochs=7"])
    text = show_yaml(cfg)
    assert yaml.safe_load(text) == to_dict(cfg)
    epochs = next(k for k in keys() if k.key == "train.epochs")
    assert f"  epochs: 7  # {epochs.meaning} (default 30)" in text.splitlines()
    assert "  take_profit: []  # " in text and "(default [1.0, 2.0, 3.0])" in text


def test_config_show_and_keys_commands(tmp_path, capsys):
    args = ["--config", "smoke", "--set", "train.epochs=7"]
    assert main(["config", "show", *args]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out) == to_dict(load_config("smoke", ["train.epochs=7"]))
    assert out.splitlines()[-1].startswith("# written to stdout")

    target = tmp_path / "resolved.yaml"
    assert main(["config", "show", *args, "--out", str(target)]) == 0
    assert f"config written to {target}" in capsys.readouterr().out
    before = target.read_text()
    assert main(["config", "show", "--out", str(target)]) == 2  # never replaces a file
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --out") and target.read_text() == before
    assert load_config(target) == load_config("smoke", ["train.epochs=7"])

    assert main(["config", "keys"]) == 0
    out = capsys.readouterr().out
    for k in keys():
        assert re.search(rf"^{re.escape(k.key)}\s+{re.escape(k.type)}\s+.*{re.escape(k.meaning)}$",
                         out, re.M), k.key


def option_entries(help_text: str) -> list[str]:
    """Each option's entry of an argparse help text (its flags and its help, one string)."""
    body = help_text.split("\n\n", 2)[-1]  # after the usage and the description
    return [" ".join(e.split("\n\n")[0].split()) for e in re.split(r"\n(?=  -)", body)
            if e.startswith("  -")]  # an entry ends at a blank line (a group's title follows)


def test_every_option_of_every_command_has_help_that_states_its_default(capsys):
    missing = []
    for cmd in COMMANDS:
        assert main([*cmd.path, "--help"]) == 0
        entries = option_entries(capsys.readouterr().out)
        assert entries, cmd.path
        for entry in entries:
            # an option that takes a value shows its METAVAR or {choices}; a flag does not
            flag = not re.match(r"(-\w, )?--[\w-]+ [A-Z{]", entry)
            if not (flag or "default" in entry.lower() or "(required" in entry):
                missing.append(f"{' '.join(cmd.path)}: {entry[:40]}")
    assert not missing, missing
    assert main(["evaluate", "--help"]) == 0
    assert "(default: test)" in " ".join(capsys.readouterr().out.split())


# ---------------------------------------------------------------------------------------------
# Trade log


def _tables(open_, high, low, close, sigma) -> MarketTables:
    t = len(close)
    arr = lambda x: np.asarray(x, np.float32)  # noqa: E731
    seg = np.array([[0, t - 1]], np.int64)
    return MarketTables(
        features=np.zeros((t, 2), np.float32), open=arr(open_), high=arr(high), low=arr(low),
        close=arr(close), sigma=arr(sigma), last_log_return=np.zeros(t, np.float32),
        instrument=np.zeros(t, np.int32),
        timestamps=np.arange(t).astype("datetime64[D]").astype("datetime64[ns]"),
        segments={s: seg for s in ("train", "validation", "test")},
        starts={s: np.arange(t - 3, dtype=np.int32) for s in ("train", "validation", "test")},
        feature_names=("a", "b"), norm_mean=np.zeros(2, np.float32),
        norm_std=np.ones(2, np.float32), instrument_names=("X",), bar_seconds=86400.0,
        bars_per_year=252.0, episode_length=3)


def test_trade_log_of_a_hand_checked_walk():
    close = [100.0, 102.0, 101.0, 105.0, 104.0, 105.0, 103.0, 103.0]
    open_, high, low = list(close), list(close), list(close)
    open_[5], high[5], low[5] = 104.5, 106.0, 104.0  # bar 5 reaches the take-profit 105.04
    sigma = [0.1, 0.1, 0.1, 0.1, 0.01, 0.1, 0.1, 0.1]  # far barriers but after bar 4
    tables = _tables(open_, high, low, close, sigma)
    # exposures -1, -0.5, 0, 0.5, 1; TP/SL at 1, 2, 3 sigma; fills at the decision bar's close
    # (docs/environment.md): the hand computation below reads one price a bar
    cfg = EnvConfig(cost_bps=10.0, fill="close")
    params = trading.make_params(tables, cfg, "test")
    actions = np.array([[[4, 2, 2], [4, 2, 2], [1, 2, 2], [2, 2, 2], [4, 0, 0],
                         [0, 2, 2]]], np.int32)  # long, hold, short half, flat, long TP, short
    trades = walk_trades(params, np.array([0]), np.array([6]), actions, tables, cfg)

    rate, day = 1e-3, lambda i: np.datetime64(i, "D")  # noqa: E731
    # by hand, in float64: a long of 1 at 100 (equity 1), cut to a short of 0.5 at 101
    units1 = 1 / 100
    cost1 = units1 * 100 * rate
    e2 = 1 - cost1 + units1 * 1.0  # marked at close 101
    units2 = -0.5 * e2 / 101
    cost2 = (units1 - units2) * 101 * rate  # one fill moves from +units1 to units2
    cost3 = -units2 * 105 * rate  # flat at 105
    e4 = e2 - cost2 + units2 * (105 - 101) - cost3
    units4 = e4 / 104  # long at 104, take-profit 104 * (1 + 1 * 0.01) hit on bar 5
    tp = 104 + 104 * 0.01
    cost4 = units4 * 104 * rate + units4 * tp * rate
    e5 = e4 + units4 * (tp - 104) - cost4
    units5 = -e5 / 105  # short at 105, open at the walk's end (close 103 of bar 6)
    cost5 = -units5 * 105 * rate
    expected = [
        ("X", day(0), day(2), 100.0, 101.0, "long", 1.0, "signal", cost1, e2 - 1),
        ("X", day(2), day(3), 101.0, 105.0, "short", 0.5, "signal", cost2 + cost3, e4 - e2),
        ("X", day(4), day(5), 104.0, tp, "long", 1.0, "take_profit", cost4, e5 - e4),
        ("X", day(5), day(6), 105.0, 103.0, "short", 1.0, "end", cost5,
         units5 * (103 - 105) - cost5),
    ]
    assert len(trades) == len(expected)
    for got, want in zip(trades, expected):
        cols = ("instrument", "entry_time", "exit_time", "entry_price", "exit_price", "side",
                "size", "exit_reason", "cost", "pnl")
        for col, value in zip(cols, want):
            if isinstance(value, float):
                assert got[col] == pytest.approx(value, rel=1e-5, abs=1e-7), (col, got)
            else:
                assert got[col] == value, (col, got)
    final = e5 + units5 * (103 - 105) - cost5
    assert sum(t["pnl"] for t in trades) == pytest.approx(final - 1, rel=1e-5)


def test_trade_log_time_and_ruin_exits():
    close = [100.0, 100.0, 100.0, 40.0, 40.0, 40.0, 40.0, 40.0]
    tables = _tables(close, close, close, close, [1.0] * 8)  # barriers out of reach
    cfg = EnvConfig(cost_bps=10.0, time_barrier=2, fill="close")
    params = trading.make_params(tables, cfg, "test")
    long_, flat = [4, 2, 2], [2, 2, 2]
    actions = np.array([[long_, long_, flat], [long_, long_, long_]], np.int32)
    trades = walk_trades(params, np.array([0, 2]), np.array([3, 3]), actions, tables, cfg)
    timed, ruined = trades
    assert (timed["exit_reason"], timed["exit_time"], timed["exit_price"]) == \
        ("time", np.datetime64(2, "D"), 100.0)
    assert timed["pnl"] == pytest.approx(-2e-3, abs=1e-7)  # two fills, nothing gained (float32)
    assert (ruined["exit_reason"], ruined["exit_time"], ruined["exit_price"]) == \
        ("ruin", np.datetime64(3, "D"), 40.0)
    # the entry's cost, the fall, and the ruin exit's cost at that close
    assert ruined["pnl"] == pytest.approx(-1e-3 + 0.01 * (40 - 100) - 0.01 * 40 * 1e-3, rel=1e-5)


# ---------------------------------------------------------------------------------------------
# The library: callbacks, writers, guard and resume rules, compile cache, lines


def test_library_train_callbacks_writers_guard_and_resume(tmp_path):
    out, lines, records = tmp_path / "run", [], []
    cfg = load_config("smoke", ["train.epochs=1"])
    api.train(cfg, out, log=lines.append, callbacks=[records.append], log_to=("jsonl",),
              final_report=False, progress=False)
    assert records == read_metrics(out) and [r["epoch"] for r in records] == [1]
    assert json.loads(json.dumps(records[0])) == records[0]  # JSON values, as in the file
    assert not (out / "tb").exists()  # --log jsonl: no TensorBoard events
    assert lines[0].startswith("compiling the phase programs")
    assert lines[1].startswith("phase programs ready in")
    assert lines[-1].startswith(f"wrote {out}: config.yaml") and "tb/" not in lines[-1]

    with pytest.raises(ConfigError, match="already holds a run"):  # the run-folder guard
        api.train(cfg, out, log=lines.append, final_report=False, progress=False)
    changed = load_config("smoke", ["train.epochs=2", "env.cost_bps=1", "network.head=16"])
    with pytest.raises(ConfigError) as err:
        api.train(changed, out, resume=True, log=lines.append, final_report=False)
    assert "env.cost_bps: 2.0 in the run, 1.0 now" in str(err.value)
    assert "network.head: 32 in the run, 16 now" in str(err.value)
    assert "train.epochs" not in str(err.value).split("(", 1)[1].split(")")[0]

    api.train(load_config("smoke", ["train.epochs=2"]), out, resume=True, log=lines.append,
              callbacks=[records.append], final_report=False, progress=False)
    assert [r["epoch"] for r in records] == [1, 2] and records == read_metrics(out)
    assert (out / "tb").is_dir()  # the default writers


def test_unknown_log_writer_is_one_error_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--config", "smoke", "--log", "jsonl,wandb", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --log: unknown writer wandb (known: jsonl, tensorboard)"]
    assert not out.exists()


def test_epoch_line_drops_init_and_compile_when_zero():
    rec = {"epoch": 2, "loss": 1.0, "epsilon": 0.5, "val": {"sharpe": 0.1, "total_return": 0.0},
           "val_buy_and_hold": {"sharpe": 0.2, "total_return": 0.01},
           "phase_ms": {"init": 0.0, "compile": 0.0, "experience": 1.0, "training": 2.0,
                        "validation": 3.0, "total": 6.0}}
    line = api.phase_line(rec, 3)
    assert "Init" not in line and "Compile" not in line and "Experience" in line
    rec["phase_ms"].update(init=5.0, compile=7.0)
    assert "Init" in api.phase_line(rec, 3) and "Compile" in api.phase_line(rec, 3)


LIBRARY_CACHE = """
import jax, sys
from foxhunt_jax import api, load_config
from foxhunt_jax.errors import FoxhuntError
from foxhunt_jax.jitcache import entry_path
cfg = load_config("smoke", ["data.source=[/no/such/prices.csv]"])
for cache in (False, True):
    try:  # fails on the data, after the caches are set up and before any compile
        api.train(cfg, compile_cache=cache, final_report=False)
    except FoxhuntError:
        pass
    print(cache, jax.config.jax_compilation_cache_dir, entry_path("p", "k") is not None)
"""


def test_library_turns_on_the_clis_compile_caches(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), FOXHUNT_JAX_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", LIBRARY_CACHE], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[:2] == ["False None False",
                                        f"True {tmp_path / 'cache'} True"], r.stdout


def test_logging_example_says_it_skipped_without_wandb_or_mlflow(capsys):
    if any(importlib.util.find_spec(m) for m in ("wandb", "mlflow")):
        pytest.skip("wandb or mlflow is installed: the example would log to it")
    script = runpy.run_path(str(ROOT / "scripts" / "log_to_wandb_or_mlflow.py"))
    assert script["main"]([]) == 0
    assert capsys.readouterr().out.startswith("skipped: neither wandb nor mlflow is installed")


# ---------------------------------------------------------------------------------------------
# The README's command-line block


def readme_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Command line\s+```bash\n(.*?)```", text, re.S).group(1)
    return [shlex.split(line, comments=True)[1:] for line in block.splitlines()
            if line.startswith("foxhunt-jax ")]


def test_readme_command_line_examples_run(in_tmp_path, capsys):
    """Every command of the block in order (bench has its own test), in-process; trains at
    tiny sizes for one epoch, and the resume trains one more."""
    commands = readme_commands()
    assert [c[0] for c in commands].count("train") >= 2 and any("--resume" in c for c in commands)
    for args in commands:
        if args[0] == "bench":
            continue
        if args[0] in ("train", "walkforward"):
            small = ["train.epochs=2"] if "--resume" in args else TINY_SIZES + ["train.epochs=1"]
            args = args + [a for s in small for a in ("--set", s)]
        if args[0] == "walkforward":  # two folds of one market shape: its own tests cover more
            folds = args.index("--folds") + 1
            args = args[:folds] + ["2"] + args[folds + 1:] + ["--window", "sliding",
                                                             "--sliding-blocks", "1"]
        code = main(args)
        captured = capsys.readouterr()
        assert code == 0, (args, captured.err[-2000:])
        last = captured.out.strip().splitlines()[-1]
        assert re.search(r"\b(wrote|written)\b", last), (args, last)  # it says what it wrote
        if args[0] == "train":  # without a terminal: a line at the compile and each final walk
            assert "compiling the phase programs" in captured.out
            assert "final walk of the test split" in captured.out

    report = in_tmp_path / "runs" / "a" / "report"
    assert [r["epoch"] for r in read_metrics(in_tmp_path / "runs" / "a")] == [1, 2]
    payload = json.loads((report / "evaluate_test.json").read_text())
    assert (report / "evaluate_test.png").stat().st_size > 0
    with open(report / "evaluate_test_trades.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and list(rows[0]) == ["instrument", "entry_time", "exit_time", "entry_price",
                                      "exit_price", "side", "size", "exit_reason", "cost", "pnl"]
    assert {r["exit_reason"] for r in rows} <= {"signal", "take_profit", "stop_loss", "time",
                                                 "ruin", "end"}
    # an instrument's trades sum to its equity change over the split
    per_instrument = payload["metrics"]["per_instrument"]["agent"]
    for name, metrics in per_instrument.items():
        pnl = sum(float(r["pnl"]) for r in rows if r["instrument"] == name)
        assert pnl == pytest.approx(metrics["total_return"], rel=1e-5, abs=1e-7), name
    assert list(report.glob("evaluate_test_eurusd_hourly-*.csv"))

"""Walk-forward (foxhunt_jax.research.walkforward): folds through time that never read their test
block, the stitched out-of-sample curve, resume and refusal, and bad input."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from foxhunt_jax import api
from foxhunt_jax.cli import main
from foxhunt_jax.config import load_config, replace
from foxhunt_jax.data.loader import load_market
from foxhunt_jax.env import trading
from foxhunt_jax.errors import ConfigError, DataError
from foxhunt_jax.research.walkforward import fold_tables, plan_folds, walkforward
from market_files import bars_frame, write_csv

WARMUP = 64
BLOCK = 40  # pooled bar times per block: fold 1 trains on 20 and validates on 20
TINY = ["env.episode_length=5", "env.time_barrier=4", "network.trunk=[16]", "network.head=8",
        "network.atoms=5", "replay.capacity=256", "train.epochs=2", "train.num_episodes=8",
        "train.train_steps=2", "train.batch_size=8", "train.validation_windows=4",
        "train.epsilon_decay_epochs=1", "train.checkpoint_every=1", "eval.random_policies=16"]
# sliding over one block: every fold's market has the same bars, so its programs compile once
OPTIONS = dict(sliding_blocks=1, validation_fraction=0.5, bootstrap_draws=200,
               log=lambda s: None)
PLAN = dict(sliding_blocks=1, validation_fraction=0.5)


def tiny_config(path):
    return load_config("smoke", TINY + [f"data.source=['{path}']"])


@pytest.fixture(scope="module")
def market_csv(tmp_path_factory):
    folder = tmp_path_factory.mktemp("walkforward")
    # a fixed market: the phase programs hold the market's values, so a fresh one would compile
    # them anew on every run; the look-ahead test draws a fresh change of the test block's prices
    frame = bars_frame(WARMUP + 3 * BLOCK, seed=7)
    return folder, frame, write_csv(frame, folder / "bars.csv")


@pytest.fixture(scope="module")
def finished(market_csv):
    folder, frame, path = market_csv
    cfg = tiny_config(path)
    report = walkforward(cfg, 2, "sliding", folder / "wf", **OPTIONS)
    return cfg, report, folder / "wf"


def restored_state(run):
    _, state = api.load_run(run)
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(state))]


def test_folds_never_read_their_test_block(market_csv, finished):
    folder, frame, _ = market_csv
    cfg, _, out = finished
    fold = plan_folds(cfg, 2, "sliding", **PLAN)[0]
    # every bar from fold 1's test block on gets new prices (the same factor for O, H, L, C)
    changed = frame.copy()
    later = changed["Date"].to_numpy() >= fold.test_start
    factor = np.exp(np.random.default_rng().normal(0, 0.05, later.sum()))
    for col in ("Open", "High", "Low", "Close"):
        changed.loc[later, col] = changed.loc[later, col] * factor
    perturbed = tiny_config(write_csv(changed, folder / "perturbed.csv"))
    assert plan_folds(perturbed, 2, "sliding", **PLAN)[0] == fold
    api.train(fold.config(perturbed), folder / "perturbed_fold_1", progress=False,
              log=lambda s: None)
    for a, b in zip(restored_state(out / "fold_1"), restored_state(folder / "perturbed_fold_1"),
                    strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    original, moved = fold_tables(cfg, fold), fold_tables(perturbed, fold)
    assert np.array_equal(original.norm_mean, moved.norm_mean)
    assert np.array_equal(original.norm_std, moved.norm_std)
    test_rows = original.timestamps >= fold.test_start
    assert not np.array_equal(original.close[test_rows], moved.close[test_rows])  # it did change
    # fold 2 trains on fold 1's test block: its statistics move with it
    second = plan_folds(cfg, 2, "sliding", **PLAN)[1]
    assert not np.array_equal(fold_tables(cfg, second).norm_mean,
                              fold_tables(perturbed, second).norm_mean)


def test_stitched_curve_covers_exactly_the_test_blocks(market_csv, finished):
    _, frame, _ = market_csv
    cfg, report, out = finished
    folds = plan_folds(cfg, 2, "sliding", **PLAN)
    dates = np.asarray(report["curve"]["dates"], "datetime64[ns]")
    assert np.all(np.diff(dates) > np.timedelta64(0))
    stamps = frame["Date"].to_numpy().astype("datetime64[ns]")
    expected = np.concatenate([stamps[(stamps >= f.test_start) & (stamps < f.test_end)]
                               for f in folds])
    assert np.array_equal(dates, expected)
    assert folds[0].test_end == folds[1].test_start and folds[1].test_end > stamps[-1]
    # sliding over one block: fold 2's market starts with the warm-up before block 1
    # expanding: every fold's market starts at the data's first bar
    assert folds[1].start == stamps[BLOCK]
    assert folds[1].validation_start == stamps[WARMUP + BLOCK + BLOCK // 2]
    assert all(f.start == stamps[0] for f in plan_folds(cfg, 2, "expanding", **PLAN))
    curve = report["curve"]
    for name in ("agent", "buy_and_hold", "flat", "random_p5", "random_p95"):
        assert len(curve[name]) == len(dates)
    assert np.all(np.asarray(curve["flat"]) == 1.0)
    o = report["out_of_sample"]
    assert o["agent"]["bars"] == len(dates) - 2  # the two folds' bars, no bar across the gap
    low, high = o["sharpe_bootstrap_95"]["low"], o["sharpe_bootstrap_95"]["high"]
    assert low <= high and 0 <= o["agent_percentile_sharpe"] <= 100
    assert o["deflated_sharpe"]["n_trials"] == 4  # 2 folds x 2 epochs
    assert [r["fold"] for r in report["per_fold"]] == [1, 2]
    saved = json.loads((out / "walkforward.json").read_text())
    assert saved["out_of_sample"]["agent"]["sharpe"] == o["agent"]["sharpe"]
    assert (out / "walkforward.png").stat().st_size > 0
    for k in (1, 2):
        assert (out / f"fold_{k}" / "run.json").is_file()
        assert (out / f"fold_{k}" / "report" / "summary.json").is_file()


def test_every_fold_pads_its_tables_to_the_largest_folds(finished):
    """Folds of different lengths get tables of one shape (``data.min_table_rows``), so that
    they run the same compiled programs."""
    cfg, _, out = finished
    folds = plan_folds(cfg, 2, "sliding", **PLAN)
    largest = max(len(fold_tables(cfg, f).close) for f in folds)
    for f in folds:
        saved = load_config(str(out / f"fold_{f.index}" / "config.yaml"))
        assert saved.data.min_table_rows == largest
        rows = api.build_trainer(f.config(saved)).env_params["train"].close.shape[0]
        assert rows == trading.padded_size(largest)
    # expanding folds differ in length; with the floor their tables have one shape
    expanding = plan_folds(cfg, 2, "expanding", **PLAN)
    lengths = [len(fold_tables(cfg, f).close) for f in expanding]
    assert lengths[0] < lengths[1]
    floor = replace(cfg, data={"min_table_rows": 4 * lengths[1]})
    shapes = {api.build_trainer(f.config(floor)).env_params["validation"].close.shape
              for f in expanding}
    assert shapes == {(trading.padded_size(4 * lengths[1]),)}


def test_second_walkforward_refuses_and_resume_continues(market_csv, finished, capsys):
    _, _, path = market_csv
    cfg, report, out = finished
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(ConfigError, match="not empty; pass --resume"):
        walkforward(cfg, 2, "sliding", out, **OPTIONS)
    with pytest.raises(ConfigError, match="differ"):
        walkforward(cfg, 2, "expanding", out, resume=True, **OPTIONS)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    # the command, resumed: both folds are finished, so no epoch is trained and the same
    # report is written again
    sets = [a for t in TINY for a in ("--set", t)]
    capsys.readouterr()
    assert main(["walkforward", "--config", "smoke", *sets, "--data", str(path), "--folds", "2",
                 "--window", "sliding", "--sliding-blocks", "1", "--validation-fraction", "0.5",
                 "--out", str(out), "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "out of sample" in printed
    assert f"{out / 'walkforward.json'} and {out / 'walkforward.png'}" in printed
    again = json.loads((out / "walkforward.json").read_text())
    assert [r["epochs"] for r in again["per_fold"]] == [2, 2]
    first = json.loads(json.dumps(report["out_of_sample"]))
    for stitched in (again["out_of_sample"], first):
        stitched.pop("sharpe_bootstrap_95")  # the command draws 2,000 resamples, the test 200
    assert again["out_of_sample"] == first


@pytest.mark.parametrize("argv, message", [
    (["--folds", "0"], "--folds must be an integer >= 1"),
    (["--folds", "two"], "--folds must be an integer >= 1"),
    (["--folds", "30"], "--folds 30: the 120 bar times"),
    (["--folds", "9"], "--folds 9: fold 1 trains on 12 bar times"),
    (["--folds", "2", "--window", "diagonal"], "--window must be one of expanding, sliding"),
    (["--folds", "2", "--validation-fraction", "1"], "--validation-fraction must be in (0, 1)"),
    (["--folds", "2", "--set", "env.name=CartPole-v1", "--set", "train.select_by=return"],
     "trains the trading env only"),
])
def test_bad_input_one_error_line_nothing_written(market_csv, tmp_path, capsys, argv, message):
    _, _, path = market_csv
    out = tmp_path / "wf"
    sets = [a for t in TINY for a in ("--set", t)]
    rc = main(["walkforward", "--config", "smoke", *sets, "--data", str(path), "--out",
               str(out), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert not out.exists()


def test_data_window_keeps_exactly_its_bars(market_csv):
    _, frame, path = market_csv
    stamps = frame["Date"].to_numpy().astype("datetime64[ns]")
    start, end = stamps[7], stamps[150]
    market = load_market([str(path)], window=[str(start), str(end)])
    (kept,) = market.instruments
    assert np.array_equal(kept.timestamps, stamps[7:150])
    assert np.array_equal(kept.close, frame["Close"].to_numpy()[7:150])
    with pytest.raises(ConfigError, match="data.window"):
        load_config("smoke", ["data.window=['2013-01-01', '2012-01-01']"])
    with pytest.raises(DataError, match="data.window"):  # 63 bars: the warm-up alone
        load_market([str(path)], window=[str(stamps[0]), str(stamps[63])])


def test_a_population_runs_inside_each_fold(market_csv, tmp_path):
    """With train.population P each fold trains P members and carries forward the one with the
    best full-validation Sharpe; the deflated Sharpe counts every epoch of every member."""
    _, _, path = market_csv
    cfg = load_config("smoke", TINY + [f"data.source=['{path}']", "train.epochs=1",
                                       "train.population=2"])
    report = walkforward(cfg, 1, "sliding", tmp_path / "wf", **OPTIONS)
    for row in report["per_fold"]:
        members = json.loads((tmp_path / "wf" / f"fold_{row['fold']}" / "population.json")
                             .read_text())["members"]
        sharpes = [m["validation"]["agent"]["sharpe"] for m in members]
        assert row["population"] == 2 and row["member"] == int(np.argmax(sharpes))
        assert row["test"]["sharpe"] == pytest.approx(
            members[row["member"]]["test"]["agent"]["sharpe"])
    assert report["out_of_sample"]["deflated_sharpe"]["n_trials"] == 1 * 2 * 1  # folds x P x epochs

"""Using a trained agent: the policy's step replays evaluation's greedy walk, act at a bar equals
the step-by-step decision there, no look-ahead, the export (loaded without foxhunt_jax) equals
the library, bad input is one error line, the docs' library example runs."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

from foxhunt_jax import api
from foxhunt_jax.cli import main
from foxhunt_jax.config import load_config
from foxhunt_jax.data.features import build_tables
from foxhunt_jax.data.loader import load_market
from foxhunt_jax.policy import Policy, Position
from foxhunt_jax.policy import spec
from foxhunt_jax.policy.export import export_policy
from foxhunt_jax.policy.latency import measure
from foxhunt_jax.policy.policy import BarInputs
from foxhunt_jax.training import validate

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("policy") / "run"
    cfg = load_config("smoke", ["train.epochs=1"])
    api.train(cfg, out, progress=False, log=lambda s: None, final_report=False)
    return out


@pytest.fixture(scope="module")
def policy(run_dir):
    return Policy.load(run_dir, agent="last")


@pytest.fixture(scope="module")
def market():
    return load_market(["builtin:us_stocks_daily"])


@pytest.fixture(scope="module")
def export_dir(policy, tmp_path_factory):
    return export_policy(policy, tmp_path_factory.mktemp("export") / "policy")


def _rows(table: dict, rows) -> BarInputs:
    """Rows of one instrument's bar table as BarInputs [len(rows), 1]."""
    take = lambda k: jnp.asarray(table[k][rows][:, None])  # noqa: E731
    return BarInputs(features=take("features"), open=take("open"), high=take("high"),
                     low=take("low"), close=take("close"), sigma=take("sigma"))


def _replay(policy, table: dict, first: int, steps: int, position=Position()):
    """Decisions [steps + 1] of one instrument from bar ``first``: start there, then step."""
    bars = _rows(table, np.arange(first, first + steps + 1))
    head = jax.tree.map(lambda x: x[0], bars)
    decision, state = policy.start_bar(head, position)

    def body(state, bar):
        d, state = policy.step(state, bar)
        return state, (d, state)

    _, (ds, states) = jax.lax.scan(body, state, jax.tree.map(lambda x: x[1:], bars))
    return decision, ds, states


def test_step_replays_the_evaluation_walk_of_the_test_split(policy, market):
    cfg = policy.cfg
    tables = build_tables(market, cfg.data.splits, cfg.env.episode_length,
                          features=cfg.data.features, split_dates=cfg.data.split_dates)
    env_params, starts, lengths = validate.evaluation_params(tables, cfg.env, "test")
    walk = validate.greedy_rollout(policy.core.learner, policy.core.backend, policy.params,
                                   env_params, jnp.asarray(starts), int(lengths.max()),
                                   jax.random.key(0), jnp.asarray(lengths))
    bar_tables = policy.bar_tables(market)
    offsets = np.concatenate([[0], np.cumsum([len(t["close"]) for t in bar_tables])])
    for i, table in enumerate(bar_tables):
        rows = slice(offsets[i], offsets[i + 1])
        # the policy's features are the training tables' rows, bit for bit
        np.testing.assert_array_equal(table["features"], tables.features[rows])
        np.testing.assert_array_equal(table["sigma"], tables.sigma[rows])
        first, n = int(starts[i] - offsets[i]), int(lengths[i])
        d0, ds, states = _replay(policy, table, first, n)
        alive = np.asarray(walk["alive"][:n, i])
        actions = np.concatenate([np.asarray(d0.action), np.asarray(ds.action[:, 0])])[:n]
        np.testing.assert_array_equal(actions[alive], np.asarray(walk["action"][:n, i])[alive])
        # equity after step k is the mark at the close of the next bar
        equity = np.asarray(ds.equity[:, 0])
        np.testing.assert_allclose(equity[alive], np.asarray(walk["equity"][:n, i])[alive],
                                   rtol=0, atol=1e-6)
        assert alive.sum() > 10


def test_act_at_a_bar_equals_the_stepwise_decision_there(policy, market, run_dir, tmp_path):
    table = policy.bar_tables(market)[0]  # AAPL
    first, steps = len(table["close"]) - 60, 40
    _, ds, states = _replay(policy, table, first, steps)
    held = np.flatnonzero(np.asarray(states.portfolio.exposure[:, 0]) != 0)
    k = int(held[-1]) if held.size else steps - 1  # a bar where a position is held
    pf = jax.tree.map(lambda x: np.asarray(x[k, 0]), states.portfolio)
    at = str(table["timestamps"][first + k + 1])
    f = lambda x: repr(float(np.float32(x)))  # noqa: E731
    args = ["act", "--run", str(run_dir), "--at", at, "--agent", "last",
            "--json", str(tmp_path / "d.json"), "--data", "builtin:us_stocks_daily"]
    if pf.exposure != 0:
        args += ["--position", f(pf.exposure), "--entry-price", f(pf.entry_price),
                 "--units", f(pf.units), "--take-profit-price", f(pf.tp_price),
                 "--stop-loss-price", f(pf.sl_price), "--bars-held", str(int(pf.time_in_trade))]
    args += ["--equity", f(pf.equity)]
    assert main(args) == 0
    rec = json.loads((tmp_path / "d.json").read_text())[0]
    assert rec["instrument"] == "AAPL" and rec["timestamp"].startswith(at[:10])
    action = np.asarray(ds.action[k, 0])
    assert rec["exposure_action"] == int(action[0])
    assert [rec["take_profit"]["action"], rec["stop_loss"]["action"]] == [int(a) for a in
                                                                         action[1:]]
    for b, name in enumerate(("exposure", "take_profit", "stop_loss")):
        # float32 forwards of batches of other sizes: rounding of Q values up to |Q| ~ 10
        np.testing.assert_allclose(rec["q"][name], np.asarray(ds.q[b][k, 0]), rtol=1e-5,
                                   atol=1e-6)


def test_act_prints_a_table_and_writes_the_json_keys(run_dir, tmp_path, capsys):
    assert main(["act", "--run", str(run_dir), "--json", str(tmp_path / "a.json")]) == 0
    text = capsys.readouterr().out
    # the default agent is the one selected on validation (the run has one epoch)
    assert "AAPL" in text and "selected agent (epoch 1 of 1, validation sharpe" in text
    assert "flat" in text
    assert text.strip().splitlines()[-1] == f"wrote {tmp_path / 'a.json'} (the decisions as JSON)"
    records = json.loads((tmp_path / "a.json").read_text())
    assert [r["instrument"] for r in records] == ["AAPL", "FB", "GOOG", "IBM", "MSFT"]
    for r in records:
        assert {"instrument", "timestamp", "exposure", "take_profit", "stop_loss", "q"} <= set(r)
        assert len(r["q"]["exposure"]) == 5 and len(r["q"]["stop_loss"]) == 3
        assert r["timestamp"] == r["data_last_timestamp"] == "2013-03-01 00:00:00"
        dist = r["return_distribution"]["exposure"]
        assert dist["mean"] == pytest.approx(r["q"]["exposure"][r["exposure_action"]], abs=1e-5)
        assert 0 <= dist["p_loss"] <= 1
        if r["exposure"] > 0:
            assert r["take_profit"]["price"] > r["close"] > r["stop_loss"]["price"]
        elif r["exposure"] < 0:
            assert r["take_profit"]["price"] < r["close"] < r["stop_loss"]["price"]


def _frame(ins, n=None) -> pd.DataFrame:
    n = len(ins) if n is None else n
    return pd.DataFrame({"Date": ins.timestamps[:n], "Open": ins.open[:n], "High": ins.high[:n],
                         "Low": ins.low[:n], "Close": ins.close[:n], "Volume": ins.volume[:n]})


def test_no_look_ahead_future_bars_do_not_change_a_decision(policy, market):
    ins = market.instruments[2]
    cut = len(ins) - 100
    at = str(ins.timestamps[cut - 1])
    past = policy.decide(_frame(ins, cut))[0]
    full = policy.decide(_frame(ins), at=at)[0]
    assert past["timestamp"] == full["timestamp"]
    assert past["q"] == full["q"] and past["exposure"] == full["exposure"]
    assert full["data_last_timestamp"] > full["timestamp"]


def test_exported_policy_loads_without_foxhunt_jax_and_equals_the_library(
        policy, market, export_dir, tmp_path):
    meta = json.loads((export_dir / "policy.json").read_text())
    assert meta["format_version"] == 1 and meta["metadata"]["config_digest"]
    for name in ("decide", "step"):
        exp = jax.export.deserialize(bytearray((export_dir / f"{name}.jax_exported").read_bytes()))
        assert exp.platforms == ("cpu", "cuda")
    assert meta["metadata"]["data_columns"] == ["open", "high", "low", "close", "volume"]
    arrays = {"names": json.dumps([i.name for i in market.instruments])}
    for ins in market.instruments:
        for k in ("open", "high", "low", "close", "volume"):
            arrays[f"{ins.name}_{k}"] = getattr(ins, k)
    np.savez(tmp_path / "bars.npz", **arrays)
    script = tmp_path / "check.py"
    script.write_text(STANDALONE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-I", str(script), str(export_dir),
                        str(tmp_path / "bars.npz"), str(tmp_path / "out.npz")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "foxhunt_jax blocked" in r.stdout
    got = np.load(tmp_path / "out.npz")
    tables = policy.bar_tables(market)
    np.testing.assert_array_equal(got["features"], np.stack([t["features"][-5] for t in tables]))
    d0, state = policy.start_bar(policy.inputs(tables, -5))
    d1, _ = policy.step(state, policy.inputs(tables, -4))
    np.testing.assert_array_equal(got["action"], np.asarray(d0.action))
    np.testing.assert_array_equal(got["action2"], np.asarray(d1.action))
    np.testing.assert_allclose(got["q0"], np.asarray(d0.q[0]), rtol=0, atol=1e-5)
    np.testing.assert_allclose(got["equity2"], np.asarray(d1.equity), rtol=0, atol=1e-6)


STANDALONE = '''
import json, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "foxhunt_jax" or name.startswith("foxhunt_jax."):
            raise ImportError("foxhunt_jax is blocked")
sys.meta_path.insert(0, Block())
folder, bars_path, out_path = sys.argv[1:4]
sys.path.insert(0, folder)
import numpy as np
import load_policy
try:
    import foxhunt_jax  # noqa: F401
    raise SystemExit("foxhunt_jax is importable")
except ImportError:
    print("foxhunt_jax blocked")
policy = load_policy.load(folder)
z = np.load(bars_path)
tables = [policy.bar_inputs(*(z[f"{n}_{k}"] for k in ("open", "high", "low", "close", "volume")))
          for n in json.loads(str(z["names"]))]
d, state = policy.decide(policy.stack(tables, -5))
d2, _ = policy.step(state, policy.stack(tables, -4))
np.savez(out_path, action=np.asarray(d["action"]), q0=np.asarray(d["q"][0]),
         action2=np.asarray(d2["action"]), equity2=np.asarray(d2["equity"]),
         features=np.stack([t["features"][-5] for t in tables]))
'''


def test_act_on_an_export_folder_equals_act_on_the_run(run_dir, export_dir, tmp_path):
    assert main(["act", "--run", str(run_dir), "--agent", "last", "--at", "2012-12-03",
                 "--json", str(tmp_path / "run.json")]) == 0
    assert main(["act", "--run", str(export_dir), "--at", "2012-12-03",
                 "--json", str(tmp_path / "exp.json")]) == 0
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("run.json", "exp.json"))
    for x, y in zip(a, b):
        assert x["exposure"] == y["exposure"] and x["timestamp"] == y["timestamp"]
        np.testing.assert_allclose(x["q"]["exposure"], y["q"]["exposure"], atol=1e-5)


def _bad_cases(run_dir: Path, export_dir: Path, market, tmp: Path) -> list:
    aapl = market.instruments[0]
    no_volume = _frame(aapl).drop(columns="Volume")
    no_volume.to_csv(tmp / "novol.csv", index=False)
    _frame(aapl, 40).to_csv(tmp / "short.csv", index=False)
    features = tmp / "features_run"
    shutil.copytree(run_dir, features)
    stats = json.loads((features / spec.STATISTICS_FILE).read_text())
    stats["feature_names"] = stats["feature_names"][:-1] + ["something_else"]
    (features / spec.STATISTICS_FILE).write_text(json.dumps(stats))
    newer = tmp / "newer_export"
    shutil.copytree(export_dir, newer)
    meta = json.loads((newer / "policy.json").read_text())
    meta["format_version"] = 99
    (newer / "policy.json").write_text(json.dumps(meta))
    return [
        (["--run", str(run_dir), "--data", str(tmp / "novol.csv")], "columns"),
        (["--run", str(features)], "trained on features"),
        (["--run", str(run_dir), "--at", "1990-01-02"], "outside the bars"),
        (["--run", str(run_dir), "--at", "2031-01-02"],
         "--at 2031-01-02 00:00:00 is outside the bars"),
        (["--run", str(run_dir), "--data", str(tmp / "short.csv")], "warm-up"),
        (["--run", str(newer)], "format version 99"),
        (["--run", str(run_dir), "--position", "0.3"], "not one of the run's exposures"),
    ]


def test_bad_input_is_one_error_line_exit_2_and_writes_nothing(run_dir, export_dir, market,
                                                               tmp_path, capsys):
    for args, needle in _bad_cases(run_dir, export_dir, market, tmp_path):
        out = tmp_path / "never.json"
        code = main(["act", *args, "--json", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2, (args, err)
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], (args, err)
        assert not out.exists()
    # an export never overwrites a folder that holds files
    code = main(["export", "--run", str(run_dir), "--out", str(export_dir)])
    assert code == 2 and "already exists" in capsys.readouterr().err


def test_an_instrument_the_run_never_saw_is_decided(run_dir, market, tmp_path):
    _frame(market.instruments[0]).to_csv(tmp_path / "NEWCO.csv", index=False)
    assert main(["act", "--run", str(run_dir), "--data", str(tmp_path / "NEWCO.csv"),
                 "--json", str(tmp_path / "n.json")]) == 0
    rec = json.loads((tmp_path / "n.json").read_text())[0]
    assert rec["instrument"] == "NEWCO" and rec["seen_in_training"] is False


def test_runs_without_stored_statistics_recompute_them(run_dir, policy, tmp_path):
    old = tmp_path / "old_run"
    shutil.copytree(run_dir, old)
    (old / spec.STATISTICS_FILE).unlink()
    warnings = []
    again = Policy.load(old, agent="last", warn=warnings.append)
    assert warnings and spec.STATISTICS_FILE in warnings[0]
    assert again.stats["norm_mean"] == policy.stats["norm_mean"]
    assert again.stats["norm_std"] == policy.stats["norm_std"]


def test_latency_measures_library_and_export(run_dir, export_dir):
    res = measure(run_dir, instruments=(1, 3), calls=5, warmup=1, export_dir=export_dir)
    for path in ("library", "exported"):
        for n in (1, 3):
            assert res[path][n]["calls"] == 5
            assert 0 < res[path][n]["median_us"] <= res[path][n]["p99_us"]


@pytest.mark.parametrize("doc", ["README.md", "docs/using.md"])
def test_docs_library_example_runs(doc, run_dir, in_tmp_path):
    text = (ROOT / doc).read_text()
    section = text.split("## Using a trained agent", 1)[1]
    if doc != "README.md":
        section = section.split("### Library", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (in_tmp_path / "runs").mkdir()
    shutil.copytree(run_dir, in_tmp_path / "runs" / "smoke")
    scope = {}
    exec(compile(block, doc, "exec"), scope)
    assert scope["decisions"][0]["instrument"] == "AAPL"
    assert (in_tmp_path / "runs" / "smoke-policy" / "load_policy.py").exists()

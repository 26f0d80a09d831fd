"""``foxhunt-jax train`` on a gymnax env (``env.name``): end to end at tiny sizes, the episode
report and none of the trading report; unknown ids and misfitting settings are one error line;
evaluate refuses such a run."""

from __future__ import annotations

import json

import pytest

from foxhunt_jax.cli import main
from foxhunt_jax.config import read_yaml
from foxhunt_jax.training.rundir import read_metrics

TINY = ["train.epochs=2", "train.num_episodes=4", "env.episode_length=8", "train.train_steps=2",
        "replay.capacity=256", "train.validation_windows=2"]


@pytest.fixture(scope="module")
def cartpole_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gymnax") / "run"
    args = ["train", "--config", "cartpole", "--out", str(out), "--no-progress", "--log", "jsonl"]
    for setting in TINY:
        args += ["--set", setting]
    return out, main(args)


def test_train_writes_the_episode_report_and_no_trading_report(cartpole_run, capsys):
    out, code = cartpole_run
    assert code == 0
    names = {p.name for p in out.iterdir()}
    assert {"checkpoints", "config.yaml", "metrics.jsonl", "report", "selected"} <= names
    assert "normalization.json" not in names  # a trading run's policy statistics
    assert sorted(p.name for p in (out / "report").iterdir()) == ["phases.png", "returns.png",
                                                                  "summary.json"]
    cfg = read_yaml(out / "config.yaml")
    assert cfg["env"]["name"] == "CartPole-v1"
    # network.support auto, resolved from the random policy's rewards and recorded
    assert (cfg["network"]["support"], cfg["network"]["v_min"], cfg["network"]["v_max"]) == (
        "explicit", 0.0, 50.0)
    records = read_metrics(out)
    assert [r["epoch"] for r in records] == [1, 2]
    for r in records:
        assert set(r["val"]) == {"return", "return_min", "return_max", "length"}
        assert 1 <= r["val"]["return_min"] <= r["val"]["return"] <= r["val"]["return_max"] <= 500
        assert r["env_steps"] == r["epoch"] * 4 * 8 and r["select_metric"] == "return"
        assert "val_buy_and_hold" not in r and "val_loss" not in r
    summary = json.loads((out / "report" / "summary.json").read_text())
    assert summary["env"] == "CartPole-v1" and summary["select_metric"] == "return"
    assert "validation" not in summary and "test" not in summary
    final = summary["final"]
    assert final["episodes"] == 100 and 1 <= final["min_return"] <= final["mean_return"] <= 500


def test_train_ends_naming_what_it_wrote_and_resumes_exactly(cartpole_run, tmp_path, capsys):
    """One epoch, then a resume to two: the same records as the two-epoch run."""
    out = tmp_path / "run"
    args = ["train", "--config", "cartpole", "--out", str(out), "--no-progress", "--log", "jsonl"]
    for setting in TINY[1:] + ["train.epochs=1"]:
        args += ["--set", setting]
    assert main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == (f"wrote {out}: config.yaml, metrics.jsonl, checkpoints/ (latest epoch "
                         "1), report/summary.json, report/returns.png, report/phases.png")
    assert any(line.startswith("final: mean return ") and "over 100 greedy episodes" in line
               for line in lines)
    assert not any("sharpe" in line or "B&H" in line for line in lines)
    assert main(["train", "--resume", "--out", str(out), "--set", "train.epochs=2",
                 "--no-progress", "--log", "jsonl"]) == 0
    fields = ("epoch", "loss", "grad_norm", "epsilon", "beta", "reward", "val")
    resumed = [{k: r[k] for k in fields} for r in read_metrics(out)]
    assert resumed == [{k: r[k] for k in fields} for r in read_metrics(cartpole_run[0])]


@pytest.mark.parametrize("settings, needle", [
    (["--config", "cartpole", "--set", "env.name=CartPole-v9"], "env.name"),
    (["--set", "env.name=CartPole-v1"], "train.select_by"),
    (["--config", "cartpole", "--set", "network.backend=pallas", "--set",
      "network.dtype=bfloat16"], "network.backend"),
])
def test_bad_env_settings_are_one_error_line_and_write_nothing(tmp_path, capsys, settings,
                                                               needle):
    code = main(["train", *settings, "--out", str(tmp_path / "x"), "--no-progress"])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert not (tmp_path / "x").exists()


def test_evaluate_refuses_a_gymnax_run(cartpole_run, capsys):
    out, _ = cartpole_run
    assert main(["evaluate", "--run", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "env.name CartPole-v1" in lines[0] and "trading runs" in lines[0]

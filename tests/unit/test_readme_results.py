"""The README's results section states the figures recorded by scripts/readme_results.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from scripts_loader import load_script

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "benchmarks" / "readme_results.json"


@pytest.fixture(scope="module")
def script():
    return load_script("readme_results")


@pytest.fixture(scope="module")
def recorded():
    return json.loads(RECORDED.read_text())


def test_readme_states_the_recorded_figures(script, recorded):
    readme = " ".join((ROOT / "README.md").read_text().split())
    fragments = script.readme_fragments(recorded)
    assert len(fragments) == 8 + 2 + 2 * 7  # the table, the other seeds, two walk-forwards
    missing = [f for f in fragments if f not in readme]
    assert not missing, f"README.md does not state {missing} ({RECORDED.name})"


def test_recorded_figures_name_machine_and_commit(recorded):
    assert set(recorded["machine"]) == {"processor", "jax", "device"}
    assert recorded["commit"] != "unknown" and not recorded["commit"].endswith("-dirty")
    assert {"default_seed0", "default_seed1", "default_seed2", "walkforward",
            "walkforward_population"} <= set(recorded)


def _policy(total_return, sharpe, max_drawdown, turnover, trades):
    return {"total_return": total_return, "sharpe": sharpe, "max_drawdown": max_drawdown,
            "turnover": turnover, "trades": trades, "sortino": 9.0}


def _split(agent, pct):
    band = [_policy(-0.2211, -1.6975, 0.0737, 0.86042, 1809.6),
            _policy(-0.1043, -0.7612, 0.1451, 0.8811, 1850.0),
            _policy(0.0781, 0.4669, 0.2537, 0.91049, 1892.2)]
    return {"agent": agent, "agent_percentile": {"sharpe": pct, "sortino": 1.0},
            "buy_and_hold": _policy(0.7227, 1.5583, 0.14998, 0.0021, 4),
            "flat": _policy(0.0, 0.0, 0.0, 0.0, 0),
            "random": {"policies": 200, **dict(zip(("p5", "p50", "p95"), band))}}


def test_table_rows_round_as_printed(script):
    summary = {"selected_epoch": 7,
               "validation": _split(_policy(0.32154, 1.71912, 0.061110, 0.76120, 1725), 99.5),
               "test": _split(_policy(-0.11534, -0.004, 0.201493, 0.6970, 1712), 48.0)}
    rows = script.table_rows(script.run_figures(summary))
    assert rows[0] == ("| validation | agent (selected, epoch 7) | +32.2% | +1.72 (pct 99.5) | "
                       "6.1% | 76.1% | 1725 |")
    assert rows[1] == "| validation | buy & hold | +72.3% | +1.56 | 15.0% | 0.2% | 4 |"
    assert rows[2] == "| validation | flat (cash) | 0.0% | 0.00 | 0.0% | 0.0% | 0 |"
    assert rows[3] == ("| validation | random 5% / 50% / 95% | -22.1 / -10.4 / +7.8% | "
                       "-1.70 / -0.76 / +0.47 | 7.4 / 14.5 / 25.4% | 86-91% | 1810-1892 |")
    # a Sharpe that rounds to zero is printed unsigned; 0.201493 is 20.1%
    assert rows[4] == ("| test | agent (selected, epoch 7) | -11.5% | 0.00 (pct 48) | 20.1% | "
                       "69.7% | 1712 |")


def test_differences_compare_as_printed(script, recorded):
    assert script.differences(recorded, recorded) == []
    now = copy.deepcopy(recorded)
    wf = now["walkforward"]
    wf["sharpe"] += 0.001 if round(wf["sharpe"] + 0.001, 2) == round(wf["sharpe"], 2) else -0.001
    assert script.differences(recorded, now) == []  # the last bits moved, not the figure
    wf["sharpe"] += 0.02
    wf["per_fold"][0]["selected_epoch"] += 1
    del now["default_seed2"]["test"]["agent"]["trades"]
    found = script.differences(recorded, now)
    assert len(found) == 3
    assert found[0].startswith("default_seed2.test.agent.trades: ") and found[0].endswith(
        "-> missing")
    assert found[1].startswith("walkforward.sharpe: ")
    assert found[2].startswith("walkforward.per_fold[0].selected_epoch: ")

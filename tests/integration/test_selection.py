"""Selection on validation (train.select_by), early stopping (train.patience), the selected
agent's checkpoint and everything that loads it."""

from __future__ import annotations

import json
import math
import shutil

import jax
import numpy as np
import pytest

from foxhunt_jax import api
from foxhunt_jax.cli import main
from foxhunt_jax.config import load_config
from foxhunt_jax.errors import ConfigError, FoxhuntError
from foxhunt_jax.policy.policy import Policy
from foxhunt_jax.training import checkpoint, report
from foxhunt_jax.training.rundir import read_metrics
from foxhunt_jax.training.selection import Selection
from records import without_timing
from test_report import read_events, visible_scalars

EPOCHS = 6
# checkpoints every 2 epochs: epochs 1, 3 and 5 queue the next one, and a selection made at an
# odd epoch waits in memory for the next checkpoint
SMOKE = ["train.checkpoint_every=2"]
QUIET = dict(progress=False, log=lambda s: None)


def rec(epoch, sharpe=None, total_return=None, loss=None):
    return {"epoch": epoch, "val": {"sharpe": sharpe, "total_return": total_return},
            "val_loss": loss}


def run_selection(metric, records, patience=0):
    sel, chosen, stopped_at = Selection(metric), [], None
    for r in records:
        sel, _ = sel.update(r)
        chosen.append(sel.epoch)
        if stopped_at is None and sel.stops(patience):
            stopped_at = r["epoch"]
    return sel, chosen, stopped_at


def test_selection_rules():
    values = [0.5, 0.7, 0.7, float("nan"), 0.9, 0.1]
    sel, chosen, _ = run_selection("sharpe", [rec(e + 1, sharpe=v) for e, v in enumerate(values)])
    # ties keep the earlier epoch; a NaN never wins
    assert chosen == [1, 2, 2, 2, 5, 5] and sel.value == 0.9 and sel.stale == 1
    # loss: lower is better
    _, chosen, _ = run_selection("loss", [rec(e + 1, loss=v) for e, v in enumerate([3, 2, 2.5, 1])])
    assert chosen == [1, 2, 2, 4]
    # the first epoch is selected whatever its value; a finite value then replaces a NaN
    _, chosen, _ = run_selection("total_return", [rec(1), rec(2, total_return=-0.5)])
    assert chosen == [1, 2]
    # patience counts the epochs after the selected one
    _, _, stopped = run_selection("sharpe", [rec(e + 1, sharpe=v) for e, v in
                                             enumerate([1, 2, 1.5, 1.9, 2.5, 0, 0])], patience=2)
    assert stopped == 4
    _, _, never = run_selection("sharpe", [rec(e + 1, sharpe=-e) for e in range(9)], patience=0)
    assert never is None


def test_selection_reads_only_the_validation_metric():
    record = rec(1, sharpe=1.0, total_return=0.1, loss=2.0)
    sel, _ = Selection("sharpe").update(record)
    # test-split numbers, or anything else, in a record change nothing
    other = dict(rec(2, sharpe=0.5, total_return=0.1, loss=2.0), test={"sharpe": 99.0},
                 sharpe=99.0)
    assert sel.update(other)[0].epoch == 1


def test_selection_json_round_trip():
    sel, _, _ = run_selection("sharpe", [rec(1, sharpe=float("nan")), rec(2)])
    assert sel.epoch == 1 and math.isnan(sel.value) and sel.stale == 1
    back = Selection.from_json(json.loads(json.dumps(sel.to_json())))
    assert back.to_json() == sel.to_json() and math.isnan(back.value)
    sel, _ = Selection("loss").update(rec(3, loss=1.25))
    assert Selection.from_json(json.loads(json.dumps(sel.to_json()))) == sel


@pytest.mark.parametrize("key,value,needle", [
    ("train.select_by", "sortino", "must be sharpe, total_return or loss"),
    ("train.patience", "-1", "must be >= 0"),
])
def test_bad_selection_config(key, value, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config("smoke", [f"{key}={value}"])


def params_of(run, step):
    """The parameters of ``run``'s selected step, restored into host arrays."""
    target = api.run_agent(run, api.load_run(run)[1], "last")[0].params
    return checkpoint.restore(run / checkpoint.SELECTED_DIR, step, target)[0]


def assert_same_tree(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    out = tmp_path_factory.mktemp("selection") / "full"
    res = api.train(load_config("smoke", SMOKE + [f"train.epochs={EPOCHS}"]), out, **QUIET)
    return out, res


def test_selected_epoch_is_the_best_validation_epoch_and_is_reported(full, capsys):
    out, res = full
    recs = read_metrics(out)
    sharpes = [r["val"]["sharpe"] for r in recs]
    best = int(np.nanargmax(sharpes)) + 1  # the first of equal maxima
    assert res.selection.epoch == best and recs[-1]["selected_epoch"] == best
    for r in recs:  # every record states the selection so far
        upto = sharpes[: r["epoch"]]
        assert r["selected_epoch"] == int(np.nanargmax(upto)) + 1
        assert r["best_sharpe"] == max(upto) and r["select_value"] == sharpes[r["epoch"] - 1]
        assert r["select_metric"] == "sharpe"
    # TensorBoard holds the same numbers under the same names
    shown = visible_scalars(read_events(out / "tb"))
    for key in ("selected_epoch", "best_sharpe", "select_value", "epochs_since_best"):
        assert shown[key] == {r["epoch"]: pytest.approx(r[key]) for r in recs}, key
    summary = json.loads((out / "report" / "summary.json").read_text())
    assert summary["selected_epoch"] == best and summary["select_metric"] == "sharpe"
    assert summary["best_sharpe"] == pytest.approx(max(sharpes))
    assert summary["agent"] == "selected" and summary["stopped_early"] is False
    # the selected agent's own checkpoint, with its epoch and metric
    steps = checkpoint.all_steps(out / checkpoint.SELECTED_DIR)
    assert steps[-1] == best
    _, meta = checkpoint.restore(out / checkpoint.SELECTED_DIR, best, params_of(out, best))
    assert meta["epoch"] == best and meta["select_by"] == "sharpe"
    assert meta["value"] == pytest.approx(max(sharpes))
    # the report's validation walk is the selected agent's: evaluate gives the same numbers
    metrics = api.evaluate(out, split="validation", log=lambda s: None)
    assert metrics["agent"] == pytest.approx(summary["validation"]["agent"], nan_ok=True)
    written = json.loads((out / "report" / "evaluate_validation.json").read_text())
    assert written["agent"]["agent"] == "selected" and written["agent"]["epoch"] == best
    # the CLI in this process
    assert main(["evaluate", "--run", str(out), "--split", "validation", "--agent", "last"]) == 0
    assert (f"validation split (full walk, equal-weight portfolio), last agent (epoch {EPOCHS})"
            in capsys.readouterr().out)
    last = json.loads((out / "report" / "evaluate_validation_last.json").read_text())
    assert last["agent"] == {"agent": "last", "epoch": EPOCHS}
    if best != EPOCHS:
        assert last["metrics"]["agent"] != metrics["agent"]


def test_policy_loads_the_selected_agent(full):
    out, res = full
    best = res.selection.epoch
    policy = Policy.load(out)  # agent="selected" by default
    assert policy.agent == "selected" and policy.epoch == best
    assert f"selected agent (epoch {best} of {EPOCHS}, validation sharpe" in policy.agent_note
    assert_same_tree(policy.params, params_of(out, best))
    assert_same_tree(res.selected_agent.params, params_of(out, best))
    last = Policy.load(out, agent="last")
    assert last.agent == "last" and last.epoch == EPOCHS
    assert_same_tree(last.params, res.state.agent.params)
    if best != EPOCHS:
        assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                   zip(jax.tree.leaves(policy.params), jax.tree.leaves(last.params)))


def test_resume_selects_what_an_uninterrupted_run_selects(full, tmp_path):
    """A run interrupted after epoch 5's record (its last checkpoint is epoch 4's, and a
    selection made at epoch 5 is lost) and resumed gives the uninterrupted run's records,
    selection and selected parameters."""
    out, res = full
    run, cfg = tmp_path / "interrupted", load_config("smoke", SMOKE + [f"train.epochs={EPOCHS}"])

    def interrupt(line):
        if line.startswith(f"epoch   5/{EPOCHS}"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        api.train(cfg, run, final_report=False, progress=False, log=interrupt)
    assert checkpoint.latest_step(run / "checkpoints") == 4 and len(read_metrics(run)) == 5
    resumed = api.train(cfg, run, resume=True, final_report=False, **QUIET)
    assert resumed.selection == res.selection
    assert without_timing(read_metrics(run)) == without_timing(read_metrics(out))
    best = res.selection.epoch
    assert_same_tree(params_of(run, best), params_of(out, best))
    assert checkpoint.all_steps(run / checkpoint.SELECTED_DIR) == checkpoint.all_steps(
        out / checkpoint.SELECTED_DIR)


def test_a_selection_after_the_newest_checkpoint_is_not_used_and_is_dropped(full, tmp_path):
    """A run killed after saving a selected agent and before the checkpoint that names it: the
    state in use picks the selection made at or before its epoch, and a resume removes the
    later one."""
    out, res = full
    run = tmp_path / "killed"
    shutil.copytree(out, run)
    steps = checkpoint.all_steps(run / checkpoint.SELECTED_DIR)
    newest = steps[-1]
    for step in checkpoint.all_steps(run / "checkpoints"):
        if step >= newest:
            shutil.rmtree(run / "checkpoints" / str(step))
    kept = checkpoint.all_steps(run / "checkpoints")
    if not kept or len(steps) < 2:
        pytest.skip("the run selected no agent before its last kept checkpoint")
    _, state = api.load_run(run)
    _, info = api.run_agent(run, state)
    assert info["epoch"] == max(s for s in steps if s <= kept[-1])
    (run / "run.lock").write_text("")
    api.train(load_config("smoke", SMOKE + [f"train.epochs={kept[-1]}"]), run, resume=True,
              final_report=False, **QUIET)
    assert max(checkpoint.all_steps(run / checkpoint.SELECTED_DIR)) <= kept[-1]


def test_damaged_selected_step_falls_back_with_a_warning(full, tmp_path, capsys):
    out, res = full
    run = tmp_path / "damaged"
    shutil.copytree(out, run)
    steps = checkpoint.all_steps(run / checkpoint.SELECTED_DIR)
    victim = run / checkpoint.SELECTED_DIR / str(steps[-1])
    biggest = max((p for p in victim.rglob("*") if p.is_file() and p.name != "digests.json"),
                  key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    _, state = api.load_run(run)
    if len(steps) == 1:
        with pytest.raises(FoxhuntError, match="no intact selected agent"):
            api.run_agent(run, state)
        return
    _, info = api.run_agent(run, state)
    assert info["epoch"] == steps[-2]
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and str(victim) in err


def test_patience_stops_the_run_and_a_stopped_run_stays_stopped(full, tmp_path):
    out, res = full
    sharpes = [r["val"]["sharpe"] for r in read_metrics(out)]
    _, _, stop = run_selection("sharpe", [rec(e + 1, sharpe=v) for e, v in enumerate(sharpes)],
                               patience=1)
    run = tmp_path / "patient"
    cfg = load_config("smoke", SMOKE + [f"train.epochs={EPOCHS}", "train.patience=1"])
    lines = []
    early = api.train(cfg, run, final_report=False, progress=False, log=lines.append)
    recs = read_metrics(run)
    if stop is None:  # every epoch improved: nothing stops
        assert len(recs) == EPOCHS
        return
    assert [r["epoch"] for r in recs] == list(range(1, stop + 1))
    assert any(line.startswith(f"early stop after epoch {stop}") for line in lines)
    # the epoch that stopped the run is checkpointed, with the selection
    assert checkpoint.latest_step(run / "checkpoints") == stop
    assert early.selection.epoch == res.history[stop - 1]["selected_epoch"]
    again = api.train(cfg, run, resume=True, final_report=False, **QUIET)
    assert len(read_metrics(run)) == stop and again.selection == early.selection


def test_training_plot_marks_the_selected_epoch():
    records = [dict(rec(e, sharpe=s, total_return=s / 10, loss=2.0), loss=2.5 - e / 10,
                    epsilon=1 - e / 10)
               for e, s in zip(range(1, 6), [0.1, 0.4, 0.3, 0.2, 0.35])]
    sel = Selection("sharpe")
    for r in records:
        sel, _ = sel.update(r)
        r.update(sel.record_fields(r))
    fig = report.training_figure(records)
    panels = [ax for ax in fig.axes if ax.get_lines()]
    assert len(panels) == 4
    for ax in panels:
        marks = [line for line in ax.get_lines()
                 if line.get_label() == "selected: epoch 2 (validation sharpe)"]
        assert len(marks) == 1 and list(marks[0].get_xdata()) == [2, 2]

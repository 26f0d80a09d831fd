"""Run directory (metrics.jsonl, TensorBoard, resume truncation) and the report plots."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import jax.numpy as jnp
import matplotlib.image
import numpy as np
import pytest

from foxhunt_jax.errors import DataError
from foxhunt_jax.training import report, validate
from foxhunt_jax.training.metrics import evaluation_results
from foxhunt_jax.training.rundir import RunWriter, flatten, read_metrics, to_jsonable


# ---------------------------------------------------------------------------------------------
# helpers


def read_events(tb_dir: Path) -> list:
    """All TensorBoard events in a directory, parsed from the TFRecord framing by hand."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            payload = data[pos + 12:pos + 12 + length]  # 8 length + 4 length-crc
            events.append(event_pb2.Event.FromString(payload))
            pos += 12 + length + 4  # payload + payload-crc
    return events


def visible_scalars(events) -> dict[str, dict[int, float]]:
    """What TensorBoard shows: a SessionLog START at step s hides earlier events with step >= s."""
    shown: list[tuple[str, int, float]] = []
    for ev in events:
        if ev.HasField("session_log") and ev.session_log.status == ev.session_log.START:
            shown = [x for x in shown if x[1] < ev.step]
        for v in ev.summary.value:
            shown.append((v.tag, ev.step, v.simple_value))
    out: dict[str, dict[int, float]] = {}
    for tag, step, value in shown:
        assert step not in out.setdefault(tag, {}), f"{tag} step {step} shown twice"
        out[tag][step] = value
    return out


def make_record(epoch: int, rng: np.random.Generator) -> dict:
    return {
        "epoch": epoch,
        "loss": np.float32(rng.uniform(0.2, 2.0)), "epsilon": 1.0 - 0.02 * epoch,
        "grad_norm": jnp.float32(rng.uniform()), "val_loss": float(rng.uniform(0.2, 2.0)),
        "val": {"sharpe": float(rng.normal()),
                "total_return": float(rng.normal(0, 0.05)), "trades": np.int64(epoch * 3)},
        "val_buy_and_hold": {"sharpe": 0.3, "total_return": 0.01},
        "val_random": {"sharpe": float(rng.normal(-0.5, 0.1)),
                       "total_return": float(rng.normal(-0.02, 0.01))},
        "phase_ms": {"experience": float(rng.uniform(40, 60)),
                     "training": float(rng.uniform(30, 40)),
                     "validation": float(rng.uniform(20, 30)), "total": 140.0},
    }


# ---------------------------------------------------------------------------------------------
# run directory


def test_log_writes_jsonl_and_tensorboard(tmp_path):
    rng = np.random.default_rng(0)
    records = [make_record(e, rng) for e in (1, 2, 3)]
    records[1]["loss"] = np.float32(np.nan)  # written as null, skipped in TB
    with RunWriter(tmp_path) as w:
        w.write_config("train:\n  epochs: 3\n")
        for r in records:
            w.log(r)
    assert (tmp_path / "config.yaml").read_text() == "train:\n  epochs: 3\n"
    assert (tmp_path / "checkpoints").is_dir() and (tmp_path / "report").is_dir()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2, 3]
    got = read_metrics(tmp_path)
    assert got == [to_jsonable(r) for r in records]
    assert got[1]["loss"] is None and isinstance(got[0]["val"]["trades"], int)

    shown = visible_scalars(read_events(tmp_path / "tb"))
    for r in records:
        for key, value in flatten(to_jsonable(r)).items():
            if key == "epoch" or value is None:
                assert r["epoch"] not in shown.get(key, {})
            else:
                assert shown[key][r["epoch"]] == pytest.approx(float(value), rel=1e-6)
    assert "phase_ms/experience" in shown and "val/sharpe" in shown


def test_other_processes_write_nothing(tmp_path):
    out = tmp_path / "run"
    w = RunWriter(out, process_index=1)
    w.write_config("x: 1\n")
    w.log({"epoch": 1, "loss": 1.0})
    w.truncate_after(0)
    w.close()
    assert not out.exists()


def test_partial_last_line_is_ignored_and_repaired(tmp_path):
    rng = np.random.default_rng(1)
    with RunWriter(tmp_path) as w:
        w.log(make_record(1, rng))
        w.log(make_record(2, rng))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 3, "val": {"sh')  # killed mid-write
    assert [r["epoch"] for r in read_metrics(tmp_path)] == [1, 2]
    with RunWriter(tmp_path) as w:  # a later append starts on a fresh line
        w.log(make_record(3, rng))
    assert [r["epoch"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_resume_truncates_metrics_and_tensorboard(tmp_path):
    rng = np.random.default_rng(2)
    first = [make_record(e, rng) for e in range(1, 6)]
    with RunWriter(tmp_path) as w:
        for r in first:
            w.log(r)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 6, "va')
    # resume from the checkpoint of epoch 3: epochs 4..5 are recomputed
    second = [make_record(e, rng) for e in (4, 5, 6)]
    with RunWriter(tmp_path) as w:
        w.truncate_after(3)
        assert [r["epoch"] for r in read_metrics(tmp_path)] == [1, 2, 3]
        for r in second:
            w.log(r)
    got = read_metrics(tmp_path)
    assert [r["epoch"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert got == [to_jsonable(r) for r in first[:3] + second]
    shown = visible_scalars(read_events(tmp_path / "tb"))
    want = {r["epoch"]: float(r["val"]["sharpe"]) for r in first[:3] + second}
    assert shown["val/sharpe"] == pytest.approx(want)


def test_corrupt_middle_line_is_a_data_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1}\nnot json\n{"epoch": 3}\n')
    with pytest.raises(DataError, match=r"metrics.jsonl, row 2: is not valid JSON lines"):
        read_metrics(tmp_path)


def test_to_jsonable_and_bad_records(tmp_path):
    value = {"a": np.float64(1.5), "b": jnp.int32(2), "c": np.array([1.0, np.inf]),
             "d": (np.bool_(True), None, "s"), 3: jnp.array(0.25, jnp.bfloat16)}
    assert to_jsonable(value) == {"a": 1.5, "b": 2, "c": [1.0, None], "d": [True, None, "s"],
                                  "3": 0.25}
    with pytest.raises(TypeError, match="cannot write object"):
        to_jsonable({"x": object()})
    assert flatten({"a": {"b": {"c": 1}}, "d": 2}) == {"a/b/c": 1, "d": 2}
    with RunWriter(tmp_path) as w:
        for bad in ({"train": {}}, {"epoch": 1.0}, {"epoch": True}):
            with pytest.raises(ValueError, match="integer 'epoch'"):
                w.log(bad)
    assert read_metrics(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# report


def ref_drawdown(path):
    out, peak = [], -math.inf
    for v in path:
        if not math.isfinite(v):
            out.append(math.nan)
            continue
        peak = max(peak, v)
        out.append(v / peak - 1.0)
    return np.array(out)


def synthetic_evaluation(rng, policies=40, steps=60):
    """An evaluation (metrics.evaluation_results) of made-up walks: three instruments whose
    dates start apart and whose lengths differ, an agent, buy-and-hold, flat and ``policies``
    random policies."""
    lengths = np.array([steps, steps - 17, steps - 30])
    dates = [np.datetime64("2021-01-04") + np.arange(5 * w, 5 * w + n + 1).astype("timedelta64[D]")
             for w, n in enumerate(lengths)]

    def walks(mu, lead=()):
        r = rng.normal(mu, 0.01, lead + (3, steps))
        eq = np.concatenate([np.ones(lead + (3, 1)), np.exp(np.cumsum(r, axis=-1))], axis=-1)
        eq[..., np.arange(steps + 1)[None, :] > lengths[:, None]] = np.nan
        x = rng.choice([-1.0, 0.0, 0.5, 1.0], lead + (3, steps))
        fills = rng.integers(0, 3, lead + (3, steps))
        return {"equity": eq, "exposure": x, "traded": fills > 0, "trades": fills,
                "turnover": fills * rng.random(lead + (3, steps))}

    paths = {"agent": walks(0.001), "buy_and_hold": walks(0.0003),
             "flat": validate.flat_paths(lengths)}
    return evaluation_results(paths, walks(-0.0004, (policies,)), dates, ["x", "y", "z"], 252.0)


def table_cells(text: str) -> dict:
    """metric -> column -> cell of a metrics_table text."""
    lines = text.splitlines()
    top = next(i for i, ln in enumerate(lines) if ln.startswith("metric "))
    header = lines[top].split()[1:]
    return {ln.split()[0]: dict(zip(header, ln.split()[1:])) for ln in lines[top + 2:]}


def test_equity_figure_legends_state_the_table_s_numbers(tmp_path):
    evaluation = synthetic_evaluation(np.random.default_rng(3))
    report.write_report(tmp_path, {"test": evaluation["metrics"]}, {"test": evaluation}, [])
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())["test"]
    cells = table_cells(report.evaluation_table(summary))
    fig = report.equity_figure(evaluation, "test split")
    ax, ax_dd, ax_x = fig.axes
    legends = [t.get_text() for t in ax.get_legend().get_texts()]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    dates = evaluation["dates"]
    for name in ("agent", "buy_and_hold", "flat"):
        label = next(lb for lb in legends if lb.startswith(report.POLICY_STYLE[name]["label"]))
        for key, word in (("total_return", "return"), ("max_drawdown", "max drawdown"),
                          ("sharpe", "Sharpe")):
            assert f"{word} {cells[key][name]}" in label, (name, key, label)
        # the line drawn is the curve of those numbers, on the portfolio's dates
        y = lines[label].get_ydata()
        np.testing.assert_array_equal(lines[label].get_xdata(), dates)
        assert y[-1] - 1.0 == pytest.approx(summary[name]["total_return"], rel=1e-12, abs=1e-15)
        assert -np.min(ref_drawdown(y)) == pytest.approx(summary[name]["max_drawdown"], abs=1e-12)
    band = next(lb for lb in legends if "5-95% band" in lb)
    assert ("x40" in band and f"return {cells['total_return']['random_p5']} to "
            f"{cells['total_return']['random_p95']}" in band)
    # the band drawn ends at the table's 5th and 95th percentile of total return
    verts = ax.collections[0].get_paths()[0].vertices
    at_end = verts[np.isclose(verts[:, 0], verts[:, 0].max()), 1]
    for q in ("p5", "p95"):
        assert np.min(np.abs(at_end - 1.0 - summary["random"][q]["total_return"])) < 1e-12
    median = next(lb for lb in legends if "median" in lb)
    assert f"return {cells['total_return']['random_p50']}" in median
    # the flat row of the table, and the agent's exposure over the dates it is held
    assert cells["total_return"]["flat"] == "+0.00%" and cells["trades"]["flat"] == "0"
    step = ax_x.get_lines()[0]
    np.testing.assert_array_equal(step.get_xdata(), dates[:-1])
    np.testing.assert_allclose(step.get_ydata(), evaluation["exposure"]["agent"])
    assert ax.get_title() == "test split" and ax_x.get_xlabel() == "date"
    bad = dict(evaluation, curves=dict(evaluation["curves"], agent=np.ones(5)))
    with pytest.raises(ValueError, match=f"curve 'agent' has 5 points for {len(dates)} dates"):
        report.equity_figure(bad, "x")


def test_evaluation_table_columns():
    evaluation = synthetic_evaluation(np.random.default_rng(12))
    metrics = evaluation["metrics"]
    text = report.evaluation_table(metrics, title="test split")
    assert text.splitlines()[1].split() == ["metric", "agent", "buy_and_hold", "flat",
                                            "random_p5", "random_p50", "random_p95", "agent_pct"]
    cells = table_cells(text)
    assert cells["sharpe"]["random_p50"] == f"{metrics['random']['p50']['sharpe']:+.2f}"
    assert cells["sharpe"]["agent_pct"] == f"{metrics['agent_percentile']['sharpe']:.1f}"
    assert cells["turnover"]["agent_pct"] == "-"  # no better side


def test_training_and_phase_figures_show_the_records():
    rng = np.random.default_rng(4)
    records = [make_record(e, rng) for e in range(1, 9)]
    records[0]["phase_ms"].update(init=9.0, compile=2500.0, experience=900.0, total=3600.0)
    fig = report.training_figure(records)
    a_loss, a_eps, a_sharpe, a_ret = fig.axes
    by_label = {ln.get_label(): ln for ax in fig.axes for ln in ax.get_lines()
                if not ln.get_label().startswith("_")}
    np.testing.assert_allclose(by_label["training loss"].get_ydata(),
                               [float(r["loss"]) for r in records])
    np.testing.assert_allclose(a_eps.get_lines()[0].get_ydata(),
                               [r["epsilon"] for r in records])
    sharpe = [ln for ln in a_sharpe.get_lines() if ln.get_label() == "agent"][0]
    np.testing.assert_allclose(sharpe.get_ydata(), [r["val"]["sharpe"] for r in records])
    np.testing.assert_array_equal(sharpe.get_xdata(), np.arange(1, 9))

    fig = report.phases_figure(records)
    ax, ax_once = fig.axes
    heights = np.zeros(8)
    for patch in ax.patches:  # stacked bars: heights per epoch add up
        heights[int(round(patch.get_x() + patch.get_width() / 2)) - 1] += patch.get_height()
    want = [sum(r["phase_ms"][k] for k in ("experience", "training", "validation"))
            + max(r["phase_ms"]["total"] - sum(r["phase_ms"].get(k, 0.0) for k in
                  ("experience", "training", "validation", "init", "compile")), 0.0)
            for r in records]
    np.testing.assert_allclose(heights, want)
    assert ax.get_ylim()[1] < want[0]  # epoch 1 is cut so the other bars stay readable
    texts = [t.get_text() for t in ax.texts]
    assert any(t.startswith("epoch 1: ") and "bar cut" in t for t in texts)
    assert sorted(t.get_text().strip() for t in ax_once.texts) == ["2.50 s", "9.0 ms"]


def test_missing_keys_are_marked_not_recorded():
    records = [{"epoch": e, "loss": 1.0 / e} for e in (1, 2, 3)]
    fig = report.training_figure(records)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "epsilon: not recorded" in texts
    assert any("Sharpe" in t and "not recorded" in t for t in texts)
    fig = report.phases_figure(records)
    assert "phase times: not recorded" in [t.get_text() for t in fig.axes[0].texts]


def test_write_report_files(tmp_path):
    rng = np.random.default_rng(5)
    with RunWriter(tmp_path) as w:
        for e in range(1, 6):
            w.log(make_record(e, rng))
    evaluations = {split: synthetic_evaluation(rng) for split in ("validation", "test")}
    summary = {"test": {"agent": {"sharpe": np.float32(1.25), "trades": np.int64(7)}},
               "bars_per_year": 252.0, "loss": float("nan")}
    written = report.write_report(tmp_path, summary, evaluations)
    names = sorted(p.name for p in written)
    assert names == ["equity_test.png", "equity_validation.png", "phases.png", "summary.json",
                     "training.png"]
    assert json.loads((tmp_path / "report" / "summary.json").read_text()) == to_jsonable(summary)
    sizes = {"equity_test.png": (960, 1200), "equity_validation.png": (960, 1200),
             "training.png": (900, 1320), "phases.png": (600, 1440)}
    for name, hw in sizes.items():
        img = matplotlib.image.imread(tmp_path / "report" / name)
        assert img.shape[:2] == hw
        assert img[..., :3].std() > 0.05  # not blank
    assert not list((tmp_path / "report").glob("*.tmp*"))


def test_phases_without_host_overhead_have_no_other_bar():
    records = []
    for e in (1, 2, 3):
        ms = {"init": 5.0 if e == 1 else 0.0, "compile": 900.0 if e == 1 else 0.0,
              "experience": 50.0 + e, "training": 30.0, "validation": 20.0 / 3}
        ms["total"] = sum(ms.values())  # the trainer's total: the phases and nothing else
        records.append({"epoch": e, "phase_ms": ms})
    ax = report.phases_figure(records).axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["experience", "training", "validation"]


def test_metrics_table_formats_each_policy_column():
    from foxhunt_jax.training.metrics import METRIC_KEYS, trading_metrics

    rng = np.random.default_rng(6)
    eq = np.cumprod(np.exp(rng.normal(0, 0.01, (3, 41))), axis=1)
    agent = trading_metrics(eq, np.ones((3, 40)), np.full(3, 2), 252.0)
    bh = dict(agent, sharpe=None, calmar=float("inf"))
    text = report.metrics_table({"agent": agent, "buy_and_hold": bh}, title="test split")
    lines = text.splitlines()
    assert lines[0] == "test split"
    assert lines[1].split() == ["metric", "agent", "buy_and_hold"]
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines[3:]}
    assert list(rows) == list(METRIC_KEYS)
    assert rows["total_return"][0] == f"{agent['total_return']:+.2%}"
    assert rows["max_drawdown"][0] == f"{agent['max_drawdown']:.2%}"
    assert rows["sharpe"] == [f"{agent['sharpe']:+.2f}", "n/a"]
    assert rows["calmar"][1] == "+inf"
    assert rows["trades"] == ["6", "6"] and rows["bars"] == ["120", "120"]
    assert len({len(ln) for ln in lines[1:]}) == 1  # aligned columns

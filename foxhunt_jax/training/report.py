"""The end-of-run report: report/summary.json and PNG plots.

Files written under ``out_dir/report/``:

* ``summary.json``: the summary dict as given (NumPy/JAX scalars converted, NaN/Inf as null).
* ``equity_<split>.png`` for each evaluated split (``validation``, ``test``): the equal-weight
  portfolios by date (:func:`~foxhunt_jax.training.metrics.evaluation_results`) of the agent,
  buy-and-hold, flat and the random policies' 5-95% band (top; each legend entry gives the
  table's figures of its curve), their drawdowns (middle) and the agent's net exposure
  (bottom).
* ``training.png``: loss, epsilon, validation Sharpe and validation total return by epoch, read
  from the epoch records of metrics.jsonl; the last record's ``selected_epoch`` (the agent chosen
  on validation) is marked in every panel with a dashed line.
* ``phases.png``: time per phase per epoch as stacked bars, with one-off costs (init, compile) in
  a separate panel so they do not squash the per-epoch bars.

A run on a gymnax env (``env.name`` other than ``trading``) writes :func:`write_episode_report`
instead: ``summary.json``, ``returns.png`` (:func:`returns_figure`: the validation episodes'
mean return by epoch with their range, the selected epoch and the final greedy episodes' mean)
and ``phases.png``; no trading figure or baseline.

Keys read from the epoch records (nested keys joined with "/"; the trainer's record layout); a
missing key leaves its panel marked "not recorded": ``loss``, ``val_loss``, ``epsilon``,
``val/{sharpe,total_return}``, ``val_buy_and_hold/{sharpe,total_return}``, optionally
``val_random/{sharpe,total_return}``, and
``phase_ms/{init,compile,experience,training,validation,total}``.

:func:`metrics_table` formats the metrics of several policies as a text table for the log;
:func:`evaluation_table` the table of one evaluation (the same numbers as its figure).

Plots are drawn on a plain Agg canvas (no pyplot, no global backend switch).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, PercentFormatter

from foxhunt_jax.files import write_atomic
from foxhunt_jax.training.rundir import flatten, read_metrics, to_jsonable

DPI = 120
# Fixed style per policy so the same colour means the same thing in every plot.
POLICY_STYLE = {
    "agent": dict(color="tab:blue", lw=1.8, ls="-", label="agent"),
    "buy_and_hold": dict(color="tab:orange", lw=1.4, ls="--", label="buy & hold"),
    "random": dict(color="tab:gray", lw=1.2, ls=":", label="random policy"),
    "oracle": dict(color="tab:green", lw=1.4, ls="-.", label="oracle (planted signal)"),
    "flat": dict(color="black", lw=1.0, ls="-", label="flat (cash)"),
}
STEADY_PHASES = ("experience", "training", "validation")
ONE_OFF_PHASES = ("init", "compile")
PHASE_COLORS = {"experience": "tab:blue", "training": "tab:orange", "validation": "tab:green",
                "other": "tab:gray", "init": "tab:purple", "compile": "tab:red"}


def save_figure(fig: Figure, path: str | os.PathLike) -> Path:
    """Writes ``fig`` as a PNG at :data:`DPI`, whole (:func:`~foxhunt_jax.files.write_atomic`),
    its layout tightened first; returns the path."""
    FigureCanvasAgg(fig)
    fig.tight_layout()
    return write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=DPI))


def _style(name: str) -> dict:
    return dict(POLICY_STYLE.get(name, dict(lw=1.2, ls="-", label=name.replace("_", " "))))


def _drawdown(path: np.ndarray) -> np.ndarray:
    peak = np.fmax.accumulate(path)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(np.isfinite(path), path / peak - 1.0, np.nan)


def legend_label(name: str, metrics: Mapping[str, Any]) -> str:
    """A policy's legend entry: its name and its table figures (total return, max drawdown,
    Sharpe), formatted as :func:`metrics_table` formats them."""
    figures = ", ".join(f"{label} {_fmt_metric(key, metrics.get(key))}" for key, label in
                        (("total_return", "return"), ("max_drawdown", "max drawdown"),
                         ("sharpe", "Sharpe")))
    return f"{_style(name)['label']}  ({figures})"


def band_label(random: Mapping[str, Any]) -> str:
    """The random band's legend entry: the policy count and the 5th and 95th percentiles of
    total return, formatted as :func:`metrics_table` formats them."""
    ret = lambda q: _fmt_metric("total_return", random[q].get("total_return"))  # noqa: E731
    return (f"random policies x{random['policies']}, 5-95% band  (return {ret('p5')} to "
            f"{ret('p95')})")


def plot_equity(path: str | os.PathLike, evaluation: Mapping[str, Any], title: str) -> Path:
    """Writes :func:`equity_figure` to the PNG ``path``."""
    return save_figure(equity_figure(evaluation, title), Path(path))


def equity_figure(evaluation: Mapping[str, Any], title: str) -> Figure:
    """The portfolios of one evaluation by date: equity, drawdown and the agent's exposure.

    Args:
      evaluation: :func:`~foxhunt_jax.training.metrics.evaluation_results` (``dates``,
        ``curves``, ``exposure``, ``metrics``): the agent, the oracle where present,
        buy-and-hold and flat as lines, the random policies as their 5-95% band (date by date)
        with their median dotted; each legend entry gives the figures the tables show for
        that curve (:func:`legend_label`, :func:`band_label`).
      title: figure title.
    """
    dates, curves, metrics = (np.asarray(evaluation["dates"]), evaluation["curves"],
                              evaluation["metrics"])
    fig = Figure(figsize=(10, 8))
    ax, ax_dd, ax_x = fig.subplots(3, 1, sharex=True,
                                   gridspec_kw=dict(height_ratios=[3, 1.1, 1.1]))
    for name in ("agent", "oracle", "buy_and_hold", "flat"):
        if name not in curves:
            continue
        curve = np.asarray(curves[name], np.float64)
        if curve.shape != dates.shape:
            raise ValueError(f"curve '{name}' has {curve.shape[0]} points for {len(dates)} dates")
        style = dict(_style(name), label=legend_label(name, metrics[name]))
        line = ax.plot(dates, curve, **style)[0]
        if name != "flat":
            ax_dd.plot(dates, _drawdown(curve), color=line.get_color(), lw=1.0, ls=style["ls"])
    if "random_p5" in curves:
        style = POLICY_STYLE["random"]
        ax.fill_between(dates, curves["random_p5"], curves["random_p95"], color=style["color"],
                        alpha=0.25, lw=0, label=band_label(metrics["random"]))
        ax.plot(dates, curves["random_p50"], **dict(style, label=(
            "random policies, median  (return "
            f"{_fmt_metric('total_return', metrics['random']['p50'].get('total_return'))})")))
    ax.set_title(title)
    ax.set_ylabel("equity")
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    ax_dd.set_ylabel("drawdown")
    ax_dd.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax_dd.grid(alpha=0.3)
    # exposure[k] is held from dates[k] to dates[k + 1]
    exposure = np.asarray(evaluation["exposure"]["agent"], np.float64)
    ax_x.step(dates[:-1], exposure, where="post", color=POLICY_STYLE["agent"]["color"], lw=1.0)
    ax_x.fill_between(dates[:-1], exposure, step="post", color=POLICY_STYLE["agent"]["color"],
                      alpha=0.2, lw=0)
    ax_x.axhline(0.0, color="black", lw=0.6, alpha=0.5)
    ax_x.set_ylim(-1.05, 1.05)
    ax_x.set_ylabel("agent net\nexposure")
    ax_x.set_xlabel("date")
    ax_x.grid(alpha=0.3)
    fig.autofmt_xdate()
    return fig


def _series(records: Sequence[Mapping], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(epochs, values) of one flattened key over the records that have it (None -> NaN)."""
    ep, val = [], []
    for rec in records:
        flat = flatten(rec)
        if key in flat and "epoch" in rec:
            v = flat[key]
            ep.append(rec["epoch"])
            val.append(np.nan if v is None else float(v))
    return np.asarray(ep, np.int64), np.asarray(val, np.float64)


def _not_recorded(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"{what}: not recorded", ha="center", va="center",
            transform=ax.transAxes, color="gray")
    ax.set_xticks([])  # an empty panel's 0..1 ticks would read as data
    ax.set_yticks([])


def _policy_panel(ax, records, metric: str, title: str, percent: bool) -> None:
    drawn = False
    for prefix, name in (("val", "agent"), ("val_buy_and_hold", "buy_and_hold"),
                         ("val_random", "random")):
        ep, v = _series(records, f"{prefix}/{metric}")
        if ep.size:
            style = _style(name)
            ax.plot(ep, v, marker="o" if ep.size <= 30 else None, ms=3, **style)
            drawn = True
    if drawn:
        ax.legend(fontsize=8, loc="best")
        ax.axhline(0.0, color="black", lw=0.6, alpha=0.5)
    else:
        _not_recorded(ax, title)
    if percent:
        ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=1))
    ax.set_title(title)
    ax.set_xlabel("epoch")


def plot_training(path: str | os.PathLike, records: Sequence[Mapping]) -> Path:
    """Writes :func:`training_figure` to the PNG ``path``."""
    return save_figure(training_figure(records), Path(path))


def _mark_selected(axes, records: Sequence[Mapping]) -> None:
    """A dashed vertical line at the last record's ``selected_epoch`` in each panel with data,
    and a ring on the agent's validation curves there."""
    last = next((r for r in reversed(records) if r.get("selected_epoch")), None)
    if last is None:
        return
    epoch, metric = int(last["selected_epoch"]), last.get("select_metric", "")
    for ax in axes:
        if ax.get_lines():
            ax.axvline(epoch, color="black", lw=1.0, ls="--", alpha=0.7,
                       label=f"selected: epoch {epoch} (validation {metric})")
            ax.legend(fontsize=8, loc="best")
    for ax, key in ((axes[2], "val/sharpe"), (axes[3], "val/total_return")):
        ep, v = _series(records, key)
        at = np.flatnonzero(ep == epoch)
        if at.size:
            ax.plot(ep[at], v[at], marker="o", ms=9, mfc="none", mec="black", ls="none")


def training_figure(records: Sequence[Mapping]) -> Figure:
    """2x2 panels by epoch: losses, epsilon, validation Sharpe, validation total return; the
    selected epoch marked (:func:`_mark_selected`)."""
    fig = Figure(figsize=(11, 7.5))
    (a_loss, a_eps), (a_sharpe, a_ret) = fig.subplots(2, 2)
    drawn = False
    for key, label, color in (("loss", "training loss", "tab:red"),
                              ("val_loss", "validation loss", "tab:purple")):
        ep, v = _series(records, key)
        if ep.size:
            a_loss.plot(ep, v, color=color, lw=1.5, label=label)
            drawn = True
    if drawn:
        finite = np.concatenate([_series(records, k)[1] for k in ("loss", "val_loss")])
        finite = finite[np.isfinite(finite)]
        if finite.size and finite.min() > 0 and finite.max() / finite.min() > 20:
            a_loss.set_yscale("log")
        a_loss.legend(fontsize=8)
    else:
        _not_recorded(a_loss, "loss")
    a_loss.set_title("C51 loss")
    a_loss.set_ylabel("cross-entropy")
    a_loss.set_xlabel("epoch")

    ep, v = _series(records, "epsilon")
    if ep.size:
        a_eps.plot(ep, v, color="tab:green", lw=1.5)
        a_eps.set_ylim(-0.02, max(1.02, float(np.nanmax(v)) + 0.02))
    else:
        _not_recorded(a_eps, "epsilon")
    a_eps.set_title("exploration epsilon")
    a_eps.set_ylabel("epsilon")
    a_eps.set_xlabel("epoch")

    _policy_panel(a_sharpe, records, "sharpe", "validation Sharpe (annualized)", percent=False)
    a_sharpe.set_ylabel("Sharpe")
    _policy_panel(a_ret, records, "total_return", "validation total return (mean over windows)",
                  percent=True)
    a_ret.set_ylabel("total return")
    _mark_selected((a_loss, a_eps, a_sharpe, a_ret), records)
    for ax in (a_loss, a_eps, a_sharpe, a_ret):
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle("Training progress")
    return fig


def _fmt_ms(ms: float) -> str:
    return f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.1f} ms"


def plot_phases(path: str | os.PathLike, records: Sequence[Mapping]) -> Path:
    """Writes :func:`phases_figure` to the PNG ``path``."""
    return save_figure(phases_figure(records), Path(path))


def phases_figure(records: Sequence[Mapping]) -> Figure:
    """Stacked per-epoch phase times, and the one-off init/compile costs in their own panel."""
    fig = Figure(figsize=(12, 5))
    ax, ax_once = fig.subplots(1, 2, gridspec_kw=dict(width_ratios=[3.2, 1]))
    epochs = np.asarray([r["epoch"] for r in records if "phase_ms" in r], np.int64)
    phases = [r["phase_ms"] for r in records if "phase_ms" in r]

    def col(name):
        return np.asarray([np.nan_to_num(float(p.get(name) or 0.0)) for p in phases])

    stack = {k: col(k) for k in STEADY_PHASES}
    if any("total" in p for p in phases):
        # Time inside the epoch outside the named phases (host work); left out when the
        # total is just the sum of the phases.
        accounted = sum(stack.values()) + col("init") + col("compile")
        other = np.clip(col("total") - accounted, 0.0, None)
        if np.any(other > 1e-3 * np.maximum(col("total"), 1e-9)):
            stack["other"] = other
    if epochs.size:
        bottom = np.zeros(epochs.size)
        if epochs.size <= 300:
            for k, v in stack.items():
                ax.bar(epochs, v, bottom=bottom, width=0.8, color=PHASE_COLORS[k], label=k)
                bottom += v
        else:  # bars thinner than a pixel: draw areas instead
            ax.stackplot(epochs, *stack.values(), labels=list(stack),
                         colors=[PHASE_COLORS[k] for k in stack])
            bottom = sum(stack.values())
        steady = bottom[1:] if bottom.size > 1 else bottom
        ref = float(np.max(steady))
        top = ref * 1.3 if ref > 0 else 1.0  # headroom for the one-row legend
        if bottom.size > 1 and bottom[0] > top:
            # A first epoch that also warmed caches would flatten every other bar: cut its bar
            # at the top of the axis and print its height instead.
            ax.text(epochs[0] + 0.6, top * 0.97,
                    f"epoch {epochs[0]}: {_fmt_ms(bottom[0])} (bar cut)", ha="left", va="top",
                    fontsize=8,
                    bbox=dict(boxstyle="round", fc="white", ec="gray", alpha=0.9))
        ax.set_ylim(0, top)
        which = "epochs after the first" if bottom.size > 1 else "the only epoch"
        ax.set_title(f"time per epoch by phase (mean over {which}: "
                     f"{_fmt_ms(float(np.mean(steady)))})", fontsize=10)
        ax.legend(fontsize=8, loc="upper right", ncol=len(stack))
        ax.xaxis.get_major_locator().set_params(integer=True)
    else:
        _not_recorded(ax, "phase times")
        ax.set_title("time per epoch by phase")
    ax.set_xlabel("epoch")
    ax.set_ylabel("milliseconds")
    ax.grid(axis="y", alpha=0.3)

    once = {k: float(col(k).sum()) for k in ONE_OFF_PHASES} if phases else {}
    if any(v > 0 for v in once.values()):
        names = list(once)
        vals = [once[k] for k in names]
        bars = ax_once.barh(names, vals, height=0.5, color=[PHASE_COLORS[k] for k in names])
        for b, v in zip(bars, vals):
            ax_once.text(b.get_width(), b.get_y() + b.get_height() / 2, " " + _fmt_ms(v),
                         va="center", fontsize=9)
        ax_once.set_xlim(0, max(vals) * 1.45)
        ax_once.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1000:g}"))
    else:
        _not_recorded(ax_once, "init / compile")
    ax_once.set_title("one-off costs (all epochs)", fontsize=10)
    ax_once.set_xlabel("seconds")
    ax_once.grid(axis="x", alpha=0.3)
    fig.suptitle("Where the time goes")
    return fig


_SIGNED_PERCENT = ("total_return", "annualized_return")
_PERCENT = ("annualized_volatility", "max_drawdown", "max_drawdown_worst", "turnover", "hit_rate",
            "time_in_market")
_RATIO = ("sharpe", "sortino", "calmar")


def _fmt_metric(key: str, value: Any) -> str:
    if isinstance(value, str):  # already formatted
        return value
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return "n/a" if value is None or np.isnan(value) else f"{value:+}"
    if key in _SIGNED_PERCENT:
        return f"{value:+.2%}"
    if key in _PERCENT:
        return f"{value:.2%}"
    if key in _RATIO:
        return f"{value:+.2f}"
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return f"{int(value):d}"
    return f"{float(value):.4g}"


def metrics_table(metrics: Mapping[str, Mapping[str, Any]], title: str = "") -> str:
    """Text table of trading metrics: one row per metric, one column per policy.

    Args:
      metrics: policy name -> metrics dict (:func:`~foxhunt_jax.training.metrics.trading_metrics`).
      title: first line of the table (left out when empty).
    """
    names = list(metrics)
    keys: list[str] = []
    for m in metrics.values():  # union of keys, first-seen order
        keys += [k for k in m if k not in keys]
    cells = [[_fmt_metric(k, metrics[n].get(k)) for n in names] for k in keys]
    key_w = max([len("metric")] + [len(k) for k in keys])
    col_w = [max([len(n)] + [len(row[j]) for row in cells]) for j, n in enumerate(names)]
    lines = [title] if title else []
    lines.append("  ".join(["metric".ljust(key_w)] + [n.rjust(w) for n, w in zip(names, col_w)]))
    lines.append("  ".join(["-" * key_w] + ["-" * w for w in col_w]))
    for k, row in zip(keys, cells):
        lines.append("  ".join([k.ljust(key_w)] + [c.rjust(w) for c, w in zip(row, col_w)]))
    return "\n".join(lines)


def evaluation_table(metrics: Mapping[str, Any], title: str = "") -> str:
    """:func:`metrics_table` of an evaluation's portfolios
    (:func:`~foxhunt_jax.training.metrics.evaluation_results`' ``metrics``): the agent, the
    oracle where present, buy-and-hold, flat, the random policies' 5th, 50th and 95th
    percentiles (``random_p5`` ...) and ``agent_pct``, the agent's
    :func:`~foxhunt_jax.training.metrics.beat_percentile` ("-" for a metric with no better side).
    """
    columns = {name: metrics[name] for name in ("agent", "oracle", "buy_and_hold", "flat")
               if name in metrics}
    for q in ("p5", "p50", "p95"):
        columns[f"random_{q}"] = metrics["random"][q]
    pct = metrics["agent_percentile"]
    columns["agent_pct"] = {k: f"{pct[k]:.1f}" if k in pct else "-" for k in metrics["agent"]}
    return metrics_table(columns, title)


def write_report(out_dir: str | os.PathLike, summary: Mapping[str, Any],
                 evaluations: Mapping[str, Mapping[str, Any]] | None = None,
                 records: Sequence[Mapping] | None = None) -> list[Path]:
    """Writes report/summary.json and every plot the inputs allow; returns the files written.

    Args:
      out_dir: the run directory (the report goes to ``out_dir/report``).
      summary: JSON-able dict (final metrics of agent and baselines, config digest, ...).
      evaluations: split name -> :func:`~foxhunt_jax.training.metrics.evaluation_results`;
        gives ``equity_<split>.png`` (:func:`equity_figure`).
      records: epoch records; read from ``out_dir/metrics.jsonl`` when None.
    """
    report_dir = Path(out_dir) / "report"
    written = [_write_summary(report_dir, summary)]

    for split, evaluation in (evaluations or {}).items():
        written.append(plot_equity(report_dir / f"equity_{split}.png", evaluation,
                                   title=f"Equal-weight portfolio on the {split} split"))
    if records is None:
        records = read_metrics(out_dir)
    if records:
        written.append(plot_training(report_dir / "training.png", records))
        written.append(plot_phases(report_dir / "phases.png", records))
    return written


def _write_summary(report_dir: Path, summary: Mapping[str, Any]) -> Path:
    """``report_dir/summary.json`` (the folder made if needed), written whole."""
    report_dir.mkdir(parents=True, exist_ok=True)
    summary_path = report_dir / "summary.json"
    return write_atomic(summary_path,
                        json.dumps(to_jsonable(summary), indent=2, allow_nan=False) + "\n")


def returns_figure(records: Sequence[Mapping], final_return: float | None = None) -> Figure:
    """A gymnax run's progress by epoch: the validation episodes' mean return (``val/return``)
    with the band from their lowest to their highest (``val/return_min``, ``val/return_max``),
    the selected epoch marked, and ``final_return`` (the final greedy episodes' mean) as a
    horizontal line."""
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    ep, mean = _series(records, "val/return")
    if ep.size:
        _, lo = _series(records, "val/return_min")
        _, hi = _series(records, "val/return_max")
        if lo.size == ep.size and hi.size == ep.size:
            ax.fill_between(ep, lo, hi, color="tab:blue", alpha=0.15,
                            label="validation episodes' range")
        ax.plot(ep, mean, color="tab:blue", lw=1.8, marker="o" if ep.size <= 30 else None,
                ms=3, label="validation mean return")
        if final_return is not None:
            ax.axhline(final_return, color="tab:green", lw=1.2, ls="-.",
                       label=f"final greedy episodes: {final_return:.2f}")
        last = next((r for r in reversed(records) if r.get("selected_epoch")), None)
        if last is not None:
            ax.axvline(int(last["selected_epoch"]), color="black", lw=1.0, ls="--", alpha=0.7,
                       label=f"selected: epoch {int(last['selected_epoch'])}")
        ax.legend(fontsize=8, loc="best")
        ax.xaxis.get_major_locator().set_params(integer=True)
    else:
        _not_recorded(ax, "validation return")
    ax.set_title("Greedy episodes' return by epoch")
    ax.set_xlabel("epoch")
    ax.set_ylabel("return (undiscounted)")
    ax.grid(alpha=0.3)
    return fig


def write_episode_report(out_dir: str | os.PathLike, summary: Mapping[str, Any],
                         records: Sequence[Mapping] | None = None) -> list[Path]:
    """A gymnax run's report: report/summary.json, returns.png (:func:`returns_figure`, with
    ``summary["final"]["mean_return"]``) and phases.png; returns the files written.
    ``records``: the epoch records, read from ``out_dir/metrics.jsonl`` when None."""
    report_dir = Path(out_dir) / "report"
    written = [_write_summary(report_dir, summary)]
    if records is None:
        records = read_metrics(out_dir)
    if records:
        final = summary.get("final", {}).get("mean_return")
        written.append(save_figure(returns_figure(records, final), report_dir / "returns.png"))
        written.append(plot_phases(report_dir / "phases.png", records))
    return written


__all__ = ["write_report", "write_episode_report", "returns_figure", "metrics_table",
           "evaluation_table", "legend_label", "band_label", "plot_equity", "plot_training",
           "plot_phases", "equity_figure", "training_figure", "phases_figure"]

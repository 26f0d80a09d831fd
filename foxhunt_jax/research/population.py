"""The population report: every member of a population, the spread over seeds of each
hyperparameter setting, and how much of the member chosen on validation survives its selection.

Input contract: ``members`` is a non-empty list of dicts, one per population member, each with

* ``"member"``: int, the member's id (unique in the population); ``"seed"``: int;
* ``"hparams"``: ``{config key: value}`` (e.g. ``{"train.learning_rate": 3e-4}``), the
  member's own hyperparameters; empty when only seeds vary; every member has the same keys;
  values are JSON scalars (finite numbers, strings, booleans, None) or lists of them;
* ``"selected_epoch"``: int, the epoch selection chose on validation;
* ``"validation"`` and ``"test"``: the selected agent's trading metrics on those splits
  (:func:`~foxhunt_jax.training.metrics.trading_metrics` keys; at least ``"sharpe"``
  (annualized), ``"total_return"`` and ``"max_drawdown"``, finite);
* ``"test_percentile"``: float in ``[0, 100]``, the agent's percentile among the random
  policies on test (:func:`~foxhunt_jax.training.metrics.beat_percentile` of its Sharpe);
* ``"validation_window_returns"``: ``[W]`` floats, the selected epoch's log return on each
  validation window (the same ``W >= 1`` windows, in the same order, for every member);
* ``"test_returns"``: ``[T]`` floats, ``T >= 2``, the per-bar log returns of the member's test
  portfolio (``diff(log(equity))``);
* ``"test_dates"``: ``[T + 1]`` ISO date strings, strictly increasing: the date of each mark of
  the equity curve ``exp(cumsum([0] + test_returns))``, the first being the start (equity 1),
  as :func:`~foxhunt_jax.training.metrics.evaluation_results` gives ``dates`` beside its
  ``curves``; the same for every member (one test period);

and ``bars_per_year`` (> 0) annualizes per-bar figures. A list that breaks the contract raises
``ValueError`` with one line naming the member (its id and its position in the list) and key;
an output folder the report may not write raises :class:`~foxhunt_jax.errors.ConfigError`.
The ``validation`` and ``test`` metrics fill the tables and the scatter plot; the DSR and the
equity band use ``test_returns`` (the two agree when both describe the same test portfolio).

What is computed:

* :func:`member_table`: one row per member.
* :func:`setting_summary`: members grouped by identical ``hparams`` (a setting, in order of
  first appearance); for each, the mean over its seeds of the validation Sharpe, test Sharpe and
  test total return with the Student-t interval (:func:`~foxhunt_jax.research.significance.mean_ci`;
  none for a setting of one member).
* :func:`chosen_member`: the member with the highest validation Sharpe (the first in the list
  on ties); the test period plays no part in the choice. For it, the deflated Sharpe ratio and
  the probability of backtest overfitting (see the function).
* :func:`plot_test_vs_validation`, :func:`plot_equity_band`: the two figures.
* :func:`population_report`: all of it written to a folder.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
from matplotlib.figure import Figure

from foxhunt_jax.errors import ConfigError
from foxhunt_jax.research.significance import (deflated_sharpe_ratio, mean_ci,
                                               probability_of_backtest_overfitting,
                                               sharpe_ratio)
from foxhunt_jax.files import write_atomic
from foxhunt_jax.training.report import save_figure
from foxhunt_jax.training.rundir import to_jsonable

REPORT_JSON = "population_report.json"
REPORT_MD = "population_report.md"
SCATTER_PNG = "population_test_vs_validation.png"
BAND_PNG = "population_equity_band.png"
REPORT_FILES = (SCATTER_PNG, BAND_PNG, REPORT_MD, REPORT_JSON)  # in the order written
REPORT_KIND = "foxhunt-jax population report"  # marks a JSON this module wrote
METRIC_KEYS = ("sharpe", "total_return", "max_drawdown")
MEMBER_KEYS = ("member", "seed", "hparams", "selected_epoch", "validation", "test",
               "test_percentile", "validation_window_returns", "test_returns", "test_dates")
MAX_SPLITS = 16  # the CSCV partitions of the PBO paper
BAND_PERCENTILES = (5, 95)  # the members' equity band, date by date
SEEDS_ONLY = "config as given (seeds only)"  # the name of the setting without hparams


class _Population(NamedTuple):
    """The checked members as arrays, in list order (``P`` members)."""

    ids: list[int]
    seeds: list[int]
    hparams: list[dict]
    hparam_keys: list[str]
    epochs: list[int]
    validation: list[dict]  # the metrics dicts as given
    test: list[dict]
    percentiles: np.ndarray  # [P]
    window_returns: np.ndarray  # [P, W]
    test_returns: np.ndarray  # [P, T]
    dates: np.ndarray  # [T + 1] datetime64[ns]
    date_strings: list[str]

    def metric(self, split: str, key: str) -> np.ndarray:
        return np.asarray([m[key] for m in getattr(self, split)], np.float64)


# ---------------------------------------------------------------------------------------------
# Checking the input


def _where(index: int, member: Any) -> str:
    ident = member.get("member") if isinstance(member, Mapping) else None
    return (f"population member {ident!r} (entry {index})" if ident is not None
            else f"population entry {index}")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value: Any) -> bool:
    return ((isinstance(value, (int, float, np.integer, np.floating))
             and not isinstance(value, (bool, np.bool_))) and math.isfinite(value))


def _check_hparam_value(value: Any, where: str, key: str) -> None:
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if isinstance(item, (float, np.floating)) and not math.isfinite(item):
            raise ValueError(f"{where}: hparams['{key}'] is not finite ({value!r})")
        if not (item is None or isinstance(item, (str, bool, np.bool_)) or _is_number(item)):
            raise ValueError(f"{where}: hparams['{key}'] must be a number, string, boolean, "
                             f"None or a list of them, got {value!r}")


def _series(value: Any, where: str, key: str, min_length: int) -> np.ndarray:
    try:
        a = np.asarray(value, np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: '{key}' must be a list of numbers") from None
    if a.ndim != 1 or a.size < min_length:
        raise ValueError(f"{where}: '{key}' must be a list of at least {min_length} numbers, "
                         f"got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{where}: '{key}' holds non-finite values (first at position "
                         f"{int(np.flatnonzero(~np.isfinite(a))[0])})")
    return a


def _dates(value: Any, where: str) -> tuple[np.ndarray, list[str]]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{where}: 'test_dates' must be a list of ISO date strings")
    strings = [str(d) for d in value]
    try:
        dates = np.asarray(strings, "datetime64[ns]")
    except ValueError as e:
        raise ValueError(f"{where}: 'test_dates' holds a date that is not ISO 8601 ({e})") \
            from None
    if dates.ndim != 1 or np.any(np.isnat(dates)) or np.any(np.diff(dates) <= np.timedelta64(0)):
        raise ValueError(f"{where}: 'test_dates' must be strictly increasing dates")
    return dates, strings


def _population(members: Sequence[Mapping]) -> _Population:
    """Checks ``members`` against the module's input contract; ValueError names the first
    member and key that break it."""
    if isinstance(members, (str, bytes, Mapping)) or not isinstance(members, Sequence):
        raise ValueError(f"members must be a list of dicts, got {type(members).__name__}")
    if not members:
        raise ValueError("members is empty: a population report needs at least one member")
    ids, seeds, hparams, epochs, val, test, pct = [], [], [], [], [], [], []
    windows, returns, first = [], [], None
    for i, m in enumerate(members):
        where = _where(i, m)
        if not isinstance(m, Mapping):
            raise ValueError(f"{where}: must be a dict, got {type(m).__name__}")
        missing = [k for k in MEMBER_KEYS if k not in m]
        if missing:
            raise ValueError(f"{where}: missing key '{missing[0]}' (a member needs "
                             f"{', '.join(MEMBER_KEYS)})")
        for key in ("member", "seed", "selected_epoch"):
            if not _is_int(m[key]):
                raise ValueError(f"{where}: '{key}' must be an integer, got {m[key]!r}")
        if int(m["member"]) in ids:
            raise ValueError(f"{where}: member id {m['member']} appears twice")
        h = m["hparams"]
        if not isinstance(h, Mapping) or not all(isinstance(k, str) for k in h):
            raise ValueError(f"{where}: 'hparams' must be a dict of config keys, got {h!r}")
        for key, value in h.items():
            _check_hparam_value(value, where, key)
        if hparams and sorted(h) != sorted(hparams[0]):
            raise ValueError(f"{where}: 'hparams' has the keys {sorted(h)}, the first member "
                             f"{sorted(hparams[0])}: every member must set the same keys")
        for split in ("validation", "test"):
            metrics = m[split]
            if not isinstance(metrics, Mapping):
                raise ValueError(f"{where}: '{split}' must be a metrics dict")
            for key in METRIC_KEYS:
                if key not in metrics:
                    raise ValueError(f"{where}: '{split}' has no '{key}'")
                if not _is_number(metrics[key]):
                    raise ValueError(f"{where}: '{split}'['{key}'] must be a finite number, "
                                     f"got {metrics[key]!r}")
        p = m["test_percentile"]
        if not (_is_number(p) and 0.0 <= p <= 100.0):
            raise ValueError(f"{where}: 'test_percentile' must be a number in [0, 100], "
                             f"got {p!r}")
        w = _series(m["validation_window_returns"], where, "validation_window_returns", 1)
        r = _series(m["test_returns"], where, "test_returns", 2)
        dates, strings = _dates(m["test_dates"], where)
        if dates.size != r.size + 1:
            raise ValueError(f"{where}: 'test_dates' has {dates.size} dates for "
                             f"{r.size} test_returns: it needs {r.size + 1} (the start and "
                             "the end of each bar)")
        if first is None:
            first = (w.size, dates, strings)
        elif w.size != first[0]:
            raise ValueError(f"{where}: 'validation_window_returns' has {w.size} windows, the "
                             f"first member {first[0]}: every member is scored on the same "
                             "windows")
        elif dates.size != first[1].size or np.any(dates != first[1]):
            raise ValueError(f"{where}: 'test_dates' differ from the first member's: every "
                             "member is tested on the same period")
        ids.append(int(m["member"]))
        seeds.append(int(m["seed"]))
        hparams.append({k: h[k] for k in (hparams[0] if hparams else h)})  # one key order
        epochs.append(int(m["selected_epoch"]))
        val.append(dict(m["validation"]))
        test.append(dict(m["test"]))
        pct.append(float(p))
        windows.append(w)
        returns.append(r)
    return _Population(ids, seeds, hparams, list(hparams[0]), epochs, val, test,
                       np.asarray(pct), np.stack(windows), np.stack(returns), first[1],
                       first[2])


def _check_bars_per_year(bars_per_year: float) -> float:
    if not (_is_number(bars_per_year) and bars_per_year > 0):
        raise ValueError(f"bars_per_year must be a finite number > 0, got {bars_per_year!r}")
    return float(bars_per_year)


# ---------------------------------------------------------------------------------------------
# Tables


def _value_text(value: Any) -> str:
    if isinstance(value, (float, np.floating)):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value_text(v) for v in value) + "]"
    return str(value)


def setting_label(hparams: Mapping[str, Any]) -> str:
    """The name of a hyperparameter setting in the tables and legends: ``key=value, ...`` in
    the keys' order, or ``SEEDS_ONLY`` when the members set no hyperparameter."""
    if not hparams:
        return SEEDS_ONLY
    return ", ".join(f"{k}={_value_text(v)}" for k, v in hparams.items())


def chosen_label(member_id: int) -> str:
    """How the tables and legends name the member chosen on validation."""
    return f"member {member_id}, chosen by validation Sharpe"


def _signed(value: float) -> str:
    return f"{value:+.2f}"


def _percent(value: float, signed: bool = True) -> str:
    return f"{value:+.2%}" if signed else f"{value:.2%}"


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]],
              left: int = 0) -> str:
    """A markdown table with padded columns; the first ``left`` columns left-aligned, the
    others right-aligned (numbers)."""
    widths = [max(len(h), *(len(r[j]) for r in rows)) if rows else len(h)
              for j, h in enumerate(header)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) if j < left else c.rjust(w)
                                 for j, (c, w) in enumerate(zip(cells, widths))) + " |"

    rule = "|" + "|".join((":" + "-" * (w + 1)) if j < left else ("-" * (w + 1) + ":")
                          for j, w in enumerate(widths)) + "|"
    return "\n".join([line(header), rule] + [line(r) for r in rows])


MEMBER_COLUMNS = ("member", "seed", "selected epoch", "validation Sharpe", "test Sharpe",
                  "test return", "test max drawdown", "test percentile")


def _member_rows(pop: _Population) -> list[dict]:
    return [{"member": pop.ids[i], "seed": pop.seeds[i], "hparams": pop.hparams[i],
             "setting": setting_label(pop.hparams[i]), "selected_epoch": pop.epochs[i],
             "validation": pop.validation[i], "test": pop.test[i],
             "test_percentile": float(pop.percentiles[i])} for i in range(len(pop.ids))]


def member_table(members: Sequence[Mapping]) -> str:
    """Markdown table of every member: id, seed, one column per hyperparameter key, selected
    epoch, validation Sharpe, test Sharpe, test total return, test max drawdown and the test
    percentile among the random policies; Sharpe ratios annualized."""
    pop = _population(members)
    header = list(MEMBER_COLUMNS[:2]) + pop.hparam_keys + list(MEMBER_COLUMNS[2:])
    rows = []
    for row in _member_rows(pop):
        v, t = row["validation"], row["test"]
        rows.append([str(row["member"]), str(row["seed"])]
                    + [_value_text(row["hparams"][k]) for k in pop.hparam_keys]
                    + [str(row["selected_epoch"]), _signed(v["sharpe"]), _signed(t["sharpe"]),
                       _percent(t["total_return"]), _percent(t["max_drawdown"], signed=False),
                       f"{row['test_percentile']:.1f}"])
    return _markdown(header, rows)


SUMMARY_METRICS = (("validation_sharpe", "validation", "sharpe", "validation Sharpe"),
                   ("test_sharpe", "test", "sharpe", "test Sharpe"),
                   ("test_total_return", "test", "total_return", "test return"))


def _interval(values: np.ndarray, level: float) -> dict:
    if values.size < 2:
        return {"mean": float(values.mean()), "low": None, "high": None}
    ci = mean_ci(values, level)
    return {"mean": ci.mean, "low": ci.low, "high": ci.high}


def _interval_text(stat: dict, fmt: Callable[[float], str]) -> str:
    if stat["low"] is None:
        return f"{fmt(stat['mean'])} (one seed)"
    return f"{fmt(stat['mean'])} [{fmt(stat['low'])}, {fmt(stat['high'])}]"


def setting_summary(members: Sequence[Mapping], level: float = 0.95) -> dict:
    """The mean over seeds of each hyperparameter setting, with its Student-t interval.

    Members with identical ``hparams`` form a setting (settings in order of first
    appearance). For each: its members' ids, ``n`` and, for the validation Sharpe, the test
    Sharpe and the test total return, ``{"mean", "low", "high"}``: the mean over the members
    and its ``level`` interval (:func:`~foxhunt_jax.research.significance.mean_ci`; ``low``
    and ``high`` None for a setting of one member).

    Returns:
      ``{"level": level, "settings": [...], "table": markdown table}``.
    """
    pop = _population(members)
    if not (_is_number(level) and 0.0 < level < 1.0):
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    groups: dict[str, list[int]] = {}
    for i, h in enumerate(pop.hparams):
        groups.setdefault(json.dumps(to_jsonable(h), sort_keys=True), []).append(i)
    settings = []
    for indices in groups.values():
        entry = {"setting": setting_label(pop.hparams[indices[0]]),
                 "hparams": pop.hparams[indices[0]],
                 "members": [pop.ids[i] for i in indices], "n": len(indices)}
        for name, split, key, _ in SUMMARY_METRICS:
            entry[name] = _interval(pop.metric(split, key)[indices], level)
        settings.append(entry)
    ci = f"{level:.0%} CI"
    header = ["setting", "n"] + [f"{label}, mean [{ci}]" for *_, label in SUMMARY_METRICS]
    rows = [[s["setting"], str(s["n"]),
             _interval_text(s["validation_sharpe"], _signed),
             _interval_text(s["test_sharpe"], _signed),
             _interval_text(s["test_total_return"], _percent)] for s in settings]
    return {"level": float(level), "settings": settings, "table": _markdown(header, rows, left=1)}


# ---------------------------------------------------------------------------------------------
# The chosen member, its deflated Sharpe ratio, and the PBO of the choice


def cscv_splits(windows: int) -> int | None:
    """The CSCV partitions for ``windows`` validation windows: the largest even ``S <= 16``
    with ``windows >= 2 S`` (two windows per block at least); None below 4 windows."""
    splits = min(MAX_SPLITS, windows // 2)
    splits -= splits % 2
    return splits if splits >= 2 else None


def _deflated(pop: _Population, index: int, bars_per_year: float) -> tuple[dict | None, str]:
    n = len(pop.ids)
    if n < 2:
        return None, "one member: nothing was chosen among, so there is nothing to deflate"
    trials = np.asarray(sharpe_ratio(pop.test_returns).per_period)
    try:
        dsr = deflated_sharpe_ratio(pop.test_returns[index], trials)
    except ValueError as e:  # a degenerate series: the inputs themselves were checked
        return None, f"the chosen member's test returns allow no deflated Sharpe ratio ({e})"
    root = math.sqrt(bars_per_year)
    return {"probability": dsr.probability, "period": "test", "n_trials": dsr.n_trials,
            "sharpe_per_bar": dsr.sharpe, "sharpe_annualized": dsr.sharpe * root,
            "expected_max_sharpe_per_bar": dsr.expected_max,
            "expected_max_sharpe_annualized": dsr.expected_max * root,
            "trial_sharpe_variance_per_bar": dsr.sharpe_variance,
            "observations": dsr.observations, "skew": dsr.skew,
            "kurtosis": dsr.kurtosis}, ""


def _overfitting(pop: _Population) -> tuple[dict | None, str]:
    n, windows = pop.window_returns.shape
    if n < 2:
        return None, "one member: CSCV needs at least two members to rank"
    splits = cscv_splits(windows)
    if splits is None:
        return None, (f"{windows} validation window(s): CSCV needs at least 4 (two blocks of "
                      "two windows)")
    result = probability_of_backtest_overfitting(pop.window_returns.T, splits,
                                                 score=lambda m: m.mean(axis=0))
    return {"pbo": result.pbo, "splits": splits, "combinations": int(result.logits.size),
            "windows": windows, "members": n,
            "score": "mean log return over the validation windows of each half",
            "logit_quartiles": [float(q) for q in np.percentile(result.logits, [25, 50, 75])]
            }, ""


def chosen_member(members: Sequence[Mapping], bars_per_year: float) -> dict:
    """The member chosen by validation Sharpe, and how much of its result survives the choice.

    **The choice** is the highest ``validation["sharpe"]``, the first in the list on ties; no
    test figure takes part.

    **Deflated Sharpe ratio** (Bailey and López de Prado, 2014;
    :func:`~foxhunt_jax.research.significance.deflated_sharpe_ratio`), on the TEST period:
    ``returns`` are the chosen member's ``test_returns`` and ``trial_sharpes`` the per-bar
    Sharpe ratios of every member's ``test_returns`` (the chosen one included), so that
    ``N = P`` counts all members tried. Why test: the function compares a Sharpe ratio with the
    best of ``N`` skill-less trials measured on the same bars (its ``SR``, skew, kurtosis and
    ``n`` come from the same series as the trials' variance), and only the test period has
    every member's per-bar returns; validation comes as per-window returns. As the choice was
    made on validation, deflating the test Sharpe as if it were the best of ``P`` test results
    is the cautious reading. None, with the reason, for one member or a constant test series.

    **Probability of backtest overfitting** (Bailey, Borwein, López de Prado and Zhu, 2017;
    :func:`~foxhunt_jax.research.significance.probability_of_backtest_overfitting`) of the
    choice procedure, over the validation windows: the ``[W, P]`` matrix of every member's
    ``validation_window_returns``, each half scored by its mean window return, with
    :func:`cscv_splits` partitions. None, with the reason, for one member or fewer than 4
    windows.

    Returns:
      dict: ``index`` (position in ``members``), ``member``, ``seed``, ``hparams``, ``setting``,
      ``selected_epoch``, ``validation``, ``test``, ``test_percentile``, ``label``
      (:func:`chosen_label`), ``deflated_sharpe`` and ``deflated_sharpe_reason``, ``pbo``
      and ``pbo_reason`` (the reasons empty when the figure is given).
    """
    pop = _population(members)
    bars_per_year = _check_bars_per_year(bars_per_year)
    index = int(np.argmax(pop.metric("validation", "sharpe")))  # first of the ties
    dsr, dsr_reason = _deflated(pop, index, bars_per_year)
    pbo, pbo_reason = _overfitting(pop)
    return {"index": index, "member": pop.ids[index], "seed": pop.seeds[index],
            "hparams": pop.hparams[index], "setting": setting_label(pop.hparams[index]),
            "selected_epoch": pop.epochs[index], "validation": pop.validation[index],
            "test": pop.test[index], "test_percentile": float(pop.percentiles[index]),
            "chosen_by": "highest validation Sharpe (first in the list on ties)",
            "label": chosen_label(pop.ids[index]),
            "deflated_sharpe": dsr, "deflated_sharpe_reason": dsr_reason,
            "pbo": pbo, "pbo_reason": pbo_reason}


def chosen_lines(chosen: Mapping[str, Any], n_members: int) -> list[str]:
    """The chosen member's lines of the report, as text."""
    v, t = chosen["validation"], chosen["test"]
    lines = [f"{chosen['label']} (of {n_members}; seed {chosen['seed']}, {chosen['setting']}, "
             f"epoch {chosen['selected_epoch']}): validation Sharpe {_signed(v['sharpe'])}; "
             f"test Sharpe {_signed(t['sharpe'])}, return {_percent(t['total_return'])}, max "
             f"drawdown {_percent(t['max_drawdown'], signed=False)}, beats "
             f"{chosen['test_percentile']:.1f}% of the random policies"]
    d = chosen["deflated_sharpe"]
    if d is None:
        lines.append(f"deflated Sharpe ratio: none ({chosen['deflated_sharpe_reason']})")
    else:
        lines.append(f"deflated Sharpe ratio (test, N = {d['n_trials']} members): "
                     f"{d['probability']:.3f}; the Sharpe of its test returns "
                     f"{_signed(d['sharpe_annualized'])} against "
                     f"{_signed(d['expected_max_sharpe_annualized'])}, the expected best of "
                     f"{d['n_trials']} skill-less members (annualized)")
    p = chosen["pbo"]
    if p is None:
        lines.append(f"probability of backtest overfitting: none ({chosen['pbo_reason']})")
    else:
        lines.append(f"probability of backtest overfitting (CSCV over {p['windows']} "
                     f"validation windows, {p['splits']} blocks, {p['combinations']} "
                     f"combinations): {p['pbo']:.3f}")
    return lines


# ---------------------------------------------------------------------------------------------
# Figures


def _setting_colors(pop: _Population) -> dict[str, str | None]:
    """A colour per setting (tab10) for up to 10 settings; None (one colour) beyond."""
    labels = list(dict.fromkeys(setting_label(h) for h in pop.hparams))
    if len(labels) > 10:
        return {label: None for label in labels}
    return {label: f"C{j}" for j, label in enumerate(labels)}


def sharpe_scatter_figure(members: Sequence[Mapping]):
    """Test Sharpe against validation Sharpe, one point per member coloured by setting (legend:
    the setting's name as the summary table gives it, and its member count), the chosen member
    marked (:func:`chosen_label`), and the line test = validation."""
    pop = _population(members)
    x, y = pop.metric("validation", "sharpe"), pop.metric("test", "sharpe")
    index = int(np.argmax(x))
    fig = Figure(figsize=(7.5, 6))
    ax = fig.subplots()
    colors = _setting_colors(pop)
    labels = [setting_label(h) for h in pop.hparams]
    if None in colors.values():
        ax.scatter(x, y, s=28, color="C0", alpha=0.8, label=f"members ({len(x)})")
    else:
        for label, color in colors.items():
            at = [i for i, lab in enumerate(labels) if lab == label]
            ax.scatter(x[at], y[at], s=28, color=color, alpha=0.8,
                       label=f"{label} ({len(at)})")
    ax.scatter(x[index], y[index], s=220, marker="*", color="gold", edgecolor="black",
               zorder=3, label=chosen_label(pop.ids[index]))
    low, high = float(min(x.min(), y.min())), float(max(x.max(), y.max()))
    pad = 0.05 * (high - low) or 0.5
    ax.plot([low - pad, high + pad], [low - pad, high + pad], color="0.4", lw=0.8, ls="--",
            label="test = validation")
    ax.axhline(0.0, color="black", lw=0.5, alpha=0.5)
    ax.axvline(0.0, color="black", lw=0.5, alpha=0.5)
    ax.set_xlabel("validation Sharpe (annualized)")
    ax.set_ylabel("test Sharpe (annualized)")
    ax.set_title(f"population of {len(x)}: test against validation Sharpe")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return fig


def equity_curves(members: Sequence[Mapping]) -> tuple[np.ndarray, np.ndarray]:
    """``(dates [T + 1] datetime64, equity [P, T + 1])``: each member's test equity
    ``exp(cumsum([0] + test_returns))``, starting at 1."""
    pop = _population(members)
    zeros = np.zeros((len(pop.ids), 1))
    return pop.dates, np.exp(np.cumsum(np.concatenate([zeros, pop.test_returns], 1), axis=1))


def band_label() -> str:
    low, high = BAND_PERCENTILES
    return f"members, {low}-{high}% band (date by date)"


def equity_band_figure(members: Sequence[Mapping]):
    """Every member's test equity by date as a thin line, the members' 5-95% band and median
    date by date (``np.percentile``, linear), the chosen member in bold (:func:`chosen_label`)."""
    pop = _population(members)
    dates, curves = equity_curves(members)
    index = int(np.argmax(pop.metric("validation", "sharpe")))
    fig = Figure(figsize=(10, 5.5))
    ax = fig.subplots()
    for i, curve in enumerate(curves):
        ax.plot(dates, curve, color="0.55", lw=0.6, alpha=0.6,
                label=f"each member ({len(curves)})" if i == 0 else None)
    low, high = np.percentile(curves, BAND_PERCENTILES, axis=0)
    ax.fill_between(dates, low, high, color="tab:gray", alpha=0.25, lw=0, label=band_label())
    ax.plot(dates, np.median(curves, axis=0), color="black", lw=1.2, ls=":",
            label="members, median")
    ax.plot(dates, curves[index], color="tab:blue", lw=1.8, label=chosen_label(pop.ids[index]))
    ax.axhline(1.0, color="black", lw=0.5, alpha=0.5)
    ax.set_title(f"population of {len(curves)}: test equity")
    ax.set_xlabel("date")
    ax.set_ylabel("equity (start = 1)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.autofmt_xdate()
    return fig


def plot_test_vs_validation(path: str | os.PathLike, members: Sequence[Mapping]) -> Path:
    """Writes :func:`sharpe_scatter_figure` to the PNG ``path``."""
    return save_figure(sharpe_scatter_figure(members), Path(path))


def plot_equity_band(path: str | os.PathLike, members: Sequence[Mapping]) -> Path:
    """Writes :func:`equity_band_figure` to the PNG ``path``."""
    return save_figure(equity_band_figure(members), Path(path))


# ---------------------------------------------------------------------------------------------
# The report folder


def _written_by_us(out: Path) -> set[str]:
    """The file names a population report JSON in ``out`` says it wrote (empty when there is
    none, or the JSON is not one)."""
    try:
        previous = json.loads((out / REPORT_JSON).read_text())
    except (OSError, ValueError):
        return set()
    if not isinstance(previous, dict) or previous.get("kind") != REPORT_KIND:
        return set()
    files = previous.get("files")
    return {f for f in files if isinstance(f, str)} if isinstance(files, list) else set()


def _check_out_dir(out: Path) -> None:
    """ConfigError unless every report file in ``out`` may be written: ``out`` is a folder (or
    absent), and each report file is absent or listed by the report JSON already there."""
    if (out.exists() or out.is_symlink()) and not out.is_dir():
        raise ConfigError(f"population report folder {out} exists and is not a folder")
    if not out.is_dir():
        return
    ours = _written_by_us(out)
    for name in REPORT_FILES:
        path = out / name
        if (path.exists() or path.is_symlink()) and name not in ours:
            raise ConfigError(f"population report: {path} exists and was not written by a "
                              f"population report (no {REPORT_JSON} of one lists it); move it "
                              "or choose another folder")


def _report_markdown(report: Mapping[str, Any]) -> str:
    """The report's markdown: the member table, the setting table, the chosen member's lines and
    the figures."""
    n = len(report["members"])
    return "\n".join([
        f"# Population report: {n} member{'s' if n != 1 else ''}", "",
        f"Test period: {report['test_period']['start']} to {report['test_period']['end']} "
        f"({report['test_period']['bars']} bars); Sharpe ratios annualized with "
        f"{report['bars_per_year']:g} bars per year.", "",
        "## Members", "", report["member_table"], "",
        f"## Settings: mean over seeds and {report['settings']['level']:.0%} confidence "
        "interval (Student t)", "", report["settings"]["table"], "",
        "## Chosen by validation", "",
        *[f"- {line}" for line in chosen_lines(report["chosen"], n)], "",
        "## Figures", "",
        f"![test against validation Sharpe]({SCATTER_PNG})", "",
        f"![test equity of every member]({BAND_PNG})", ""])


def population_report(members: Sequence[Mapping], out_dir: str | os.PathLike,
                      bars_per_year: float, level: float = 0.95) -> dict:
    """Writes the population report into ``out_dir`` and returns its content.

    Files (:data:`REPORT_FILES`): ``population_report.json`` (``kind``, ``files``, the test
    period, ``members``: one row per member, ``settings``: :func:`setting_summary` without its
    table, ``chosen``: :func:`chosen_member`), ``population_report.md`` (the two tables and
    the chosen member's lines) and the two figures (:func:`plot_test_vs_validation`,
    :func:`plot_equity_band`). Each file is written whole (a temporary file renamed), the JSON
    last.

    Bad members raise ValueError and bad ``bars_per_year`` or ``level`` ValueError before
    anything is written. ``out_dir`` is created if absent; a report file already there is
    replaced only when the population report JSON there lists it (a rerun of this report),
    otherwise ConfigError, and nothing is written.

    Returns:
      the JSON's content, with ``written``: the paths written.
    """
    bars_per_year = _check_bars_per_year(bars_per_year)
    pop = _population(members)
    settings = setting_summary(members, level)
    chosen = chosen_member(members, bars_per_year)
    report = {
        "kind": REPORT_KIND, "files": list(REPORT_FILES), "bars_per_year": bars_per_year,
        "test_period": {"start": pop.date_strings[0], "end": pop.date_strings[-1],
                        "bars": int(pop.test_returns.shape[1])},
        "band": band_label(),
        "members": _member_rows(pop),
        "settings": {k: v for k, v in settings.items() if k != "table"},
        "chosen": chosen,
    }
    text = json.dumps(to_jsonable(report), indent=2, allow_nan=False) + "\n"
    markdown = _report_markdown({**report, "member_table": member_table(members),
                                "settings": settings})
    out = Path(out_dir)
    _check_out_dir(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"population report folder {out}: cannot create it "
                          f"({(e.strerror or str(e)).lower()})") from None
    written = [plot_test_vs_validation(out / SCATTER_PNG, members),
               plot_equity_band(out / BAND_PNG, members),
               write_atomic(out / REPORT_MD, markdown),
               write_atomic(out / REPORT_JSON, text)]
    return {**report, "written": [str(p) for p in written]}


__all__ = ["population_report", "member_table", "setting_summary", "chosen_member",
           "chosen_lines", "cscv_splits", "setting_label", "chosen_label", "band_label",
           "equity_curves", "sharpe_scatter_figure", "equity_band_figure",
           "plot_test_vs_validation", "plot_equity_band", "REPORT_FILES",
           "REPORT_JSON", "REPORT_MD", "SCATTER_PNG", "BAND_PNG", "SEEDS_ONLY"]

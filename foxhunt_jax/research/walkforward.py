"""Walk-forward evaluation: K folds through time, each trained on its past and tested on the
next block, the test blocks stitched into one out-of-sample equity curve.

The pooled calendar is the one the calendar splits use: the sorted distinct times of every
instrument's bars after its warm-up (:func:`~foxhunt_jax.data.features.split_boundaries`). It
is cut into ``K + 1`` consecutive blocks of (nearly) equal counts (``np.array_split``). Fold
``k`` (1..K) tests on block ``k``; it trains on the blocks before it (``expanding``: all of
them; ``sliding``: the last ``sliding_blocks``), the last ``validation_fraction`` of those
times being its validation window. Each fold is an ordinary run folder ``DIR/fold_k`` trained
by :func:`foxhunt_jax.api.train` with ``data.window = [start, test_end]`` (no later bar is
loaded at all) and ``data.split_dates = [validation_start, test_start]``, so its
normalization statistics come from its own training rows and its selection from its own
validation window. With ``train.population`` P > 1 each fold trains P members in one program
and carries forward the member whose full validation walk has the best Sharpe (no test figure
takes part); the deflated Sharpe then counts every epoch of every member of every fold.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from matplotlib.figure import Figure

from foxhunt_jax import api
from foxhunt_jax.config import Config, replace, to_dict
from foxhunt_jax.data.features import WARMUP, build_tables
from foxhunt_jax.data.loader import load_market
from foxhunt_jax.errors import ConfigError
from foxhunt_jax.files import write_atomic
from foxhunt_jax.research.significance import (block_bootstrap_ci, deflated_sharpe_ratio,
                                               sharpe_ratio)
from foxhunt_jax.training.checkpoint import latest_step
from foxhunt_jax.training.metrics import PERCENTILES, beat_percentile, max_drawdowns
from foxhunt_jax.training.report import save_figure
from foxhunt_jax.training.rundir import to_jsonable

WINDOWS = ("expanding", "sliding")
PLAN_FILE = "walkforward_plan.txt"  # the config, folds and window a DIR was started with
BASELINES = ("buy_and_hold", "flat")


@dataclass(frozen=True)
class Fold:
    """One fold's calendar: bars with ``start <= t < test_end`` are loaded; train before
    ``validation_start``, validation before ``test_start``, test from it."""

    index: int  # 1..K
    start: np.datetime64
    validation_start: np.datetime64
    test_start: np.datetime64
    test_end: np.datetime64

    def config(self, cfg: Config) -> Config:
        iso = lambda t: str(np.datetime64(t, "ns"))  # noqa: E731
        return replace(cfg, data={"window": [iso(self.start), iso(self.test_end)],
                                  "split_dates": [iso(self.validation_start),
                                                  iso(self.test_start)]})

    def to_json(self) -> dict:
        return {"fold": self.index, **{k: str(np.datetime64(getattr(self, k), "s"))
                                       for k in ("start", "validation_start", "test_start",
                                                 "test_end")}}


def plan_folds(cfg: Config, folds: int, window: str = "expanding", sliding_blocks: int = 2,
               validation_fraction: float = 0.2) -> list[Fold]:
    """The folds of ``cfg``'s market; ConfigError for ``folds < 1``, a gymnax ``env.name``, an
    unknown ``window``, or
    a block (or a fold's train or validation part) shorter than ``env.episode_length + 1``
    pooled bar times. Reads timestamps only."""
    if isinstance(folds, bool) or not isinstance(folds, int) or folds < 1:
        raise ConfigError(f"--folds must be an integer >= 1, got {folds!r}")
    if cfg.env.name != "trading":
        raise ConfigError(f"config key 'env.name' {cfg.env.name!r}: a walk-forward cuts market "
                          "data through time, so it trains the trading env only")
    if window not in WINDOWS:
        raise ConfigError(f"--window must be one of {', '.join(WINDOWS)}, got {window!r}")
    if isinstance(sliding_blocks, bool) or not isinstance(sliding_blocks, int) \
            or sliding_blocks < 1:
        raise ConfigError(f"--sliding-blocks must be an integer >= 1, got {sliding_blocks!r}")
    if not 0 < validation_fraction < 1:
        raise ConfigError(f"--validation-fraction must be in (0, 1), got "
                          f"{validation_fraction!r}")
    market = load_market(cfg.data.source, sort=cfg.data.sort, synthetic=cfg.data.synthetic,
                         window=cfg.data.window)
    stamps = [np.asarray(i.timestamps).astype("datetime64[ns]") for i in market.instruments]
    times = np.unique(np.concatenate([s[WARMUP:] for s in stamps]))  # the splits' calendar
    every = np.unique(np.concatenate(stamps))  # with the warm-up bars
    need = cfg.env.episode_length + 1
    firsts = [int(b[0]) for b in np.array_split(np.arange(times.size), folds + 1)] + [times.size]
    shortest = min(b - a for a, b in zip(firsts[:-1], firsts[1:]))
    if shortest < need:
        raise ConfigError(f"--folds {folds}: the {times.size} bar times after the warm-up make "
                          f"{folds + 1} blocks of {shortest} or more; each needs at least "
                          f"{need} (env.episode_length + 1): use fewer folds")
    out = []
    for k in range(1, folds + 1):
        first = 0 if window == "expanding" else firsts[max(k - sliding_blocks, 0)]
        train_times = firsts[k] - first
        validation = firsts[k] - round(train_times * validation_fraction)
        if min(validation - first, firsts[k] - validation) < need:
            raise ConfigError(f"--folds {folds}: fold {k} trains on {train_times} bar times; its "
                              f"train and validation parts (validation_fraction "
                              f"{validation_fraction:g}) need {need} each: use fewer folds")
        # the market starts WARMUP pooled times before the training period (its warm-up)
        start = every[max(int(np.searchsorted(every, times[first])) - WARMUP, 0)]
        end = times[firsts[k + 1]] if k < folds else times[-1] + np.timedelta64(1, "s")
        out.append(Fold(k, start, times[validation], times[firsts[k]], end))
    return out


def fold_tables(cfg: Config, fold: Fold):
    """The market tables fold ``fold`` trains and tests on (what :func:`api.train` builds)."""
    fcfg = fold.config(cfg)
    market = load_market(fcfg.data.source, sort=fcfg.data.sort, synthetic=fcfg.data.synthetic,
                         window=fcfg.data.window)
    return build_tables(market, fcfg.data.splits, fcfg.env.episode_length,
                        features=fcfg.data.features, split_dates=fcfg.data.split_dates)


def _check_out(out: Path, resume: bool, plan_text: str) -> None:
    """A new walk-forward needs an absent or empty DIR; ``resume`` one started with the same
    config, folds and window."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"walk-forward folder {out} exists and is not a folder")
    plan = out / PLAN_FILE
    if not resume:
        if out.is_dir() and any(out.iterdir()):
            raise ConfigError(f"walk-forward folder {out} is not empty; pass --resume to "
                              "continue a walk-forward there, or choose a new folder")
        return
    if not plan.is_file():
        raise ConfigError(f"--resume: {out} holds no walk-forward ({PLAN_FILE} missing)")
    if plan.read_text() != plan_text:
        raise ConfigError(f"--resume: the config, folds or window differ from {plan} "
                          "(only train.epochs may change)")


def _plan_text(cfg: Config, folds: list[Fold], window: str) -> str:
    lines = [f"# walk-forward: {len(folds)} folds, {window} window"]
    lines += [f"# fold {f.index}: " + json.dumps(f.to_json()) for f in folds]
    settings = to_dict(cfg)
    settings["train"].pop("epochs")  # a resume may train longer
    return "\n".join(lines) + "\n" + json.dumps(to_jsonable(settings), indent=1) + "\n"


def walkforward(cfg: Config, folds: int, window: str = "expanding",
                out_dir: str | Path = "runs/walkforward", *, resume: bool = False,
                sliding_blocks: int = 2, validation_fraction: float = 0.2,
                bootstrap_draws: int = 2000, log: Callable[[str], None] | None = None) -> dict:
    """Trains and tests ``folds`` folds (:func:`plan_folds`) into ``out_dir/fold_k`` and writes
    ``out_dir/walkforward.json`` and ``walkforward.png``; returns the JSON's content.

    Bad input (see :func:`plan_folds`; an instrument without ``episode_length + 1`` bars in a
    fold's split) raises before anything is written. A non-empty ``out_dir`` is refused unless
    ``resume``: then every fold continues from its own newest checkpoint (:func:`api.train`
    with ``resume``; a finished fold trains no further epoch) or starts if it has none.
    """
    log = log or print
    out = Path(out_dir)
    plan = plan_folds(cfg, folds, window, sliding_blocks, validation_fraction)
    text = _plan_text(cfg, plan, window)
    _check_out(out, resume, text)
    # every fold's data and splits are checked before anything is written; the folds' tables
    # are padded alike (data.min_table_rows), so that every fold runs the same programs
    rows = max(len(fold_tables(cfg, fold).close) for fold in plan)
    shaped = replace(cfg, data={"min_table_rows": max(cfg.data.min_table_rows, rows)})
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / PLAN_FILE, text)
    results = []
    for fold in plan:
        run = out / f"fold_{fold.index}"
        again = resume and latest_step(run / "checkpoints") is not None
        log(f"fold {fold.index}/{len(plan)}: data from {_day(fold.start)}, validation from "
            f"{_day(fold.validation_start)}, test {_day(fold.test_start)} .. "
            f"before {_day(fold.test_end)} -> {run}")
        result = api.train(fold.config(shaped), run, resume=again, progress=False,
                           log=lambda line, k=fold.index: log(f"  [fold {k}] {line}"))
        results.append((fold, FoldResult.of(result)))
    market = load_market(cfg.data.source, sort=cfg.data.sort, synthetic=cfg.data.synthetic,
                         window=cfg.data.window)
    report = stitched_report(results, market.bars_per_year, cfg.env.time_barrier,
                             bootstrap_draws)
    report.update(folds=len(plan), window=window, sliding_blocks=sliding_blocks,
                  validation_fraction=validation_fraction)
    path = out / "walkforward.json"
    write_atomic(path, json.dumps(to_jsonable(report), indent=2) + "\n")
    plot_walkforward(out / "walkforward.png", report)
    log(summary_table(report))
    log(f"walk-forward written to {path} and {out / 'walkforward.png'} (folds in "
        f"{out}/fold_1 .. fold_{len(plan)})")
    return report


@dataclass(frozen=True)
class FoldResult:
    """What the stitched report reads of one fold's training: the agent it carries forward
    (the population member chosen on validation, or the run's selected agent), that agent's
    test walk and every validation candidate the fold's choice saw."""

    evaluation: dict  # Trainer.evaluate_split of the carried agent on the fold's test block
    selected_epoch: int
    epochs: int
    select_metric: str
    select_value: float
    member: int | None  # the chosen member of a population; None for a single agent
    population: int
    # per-bar validation Sharpe of every epoch of every member: the trials a choice saw
    trial_sharpes: np.ndarray

    @classmethod
    def of(cls, result) -> "FoldResult":
        """From :func:`foxhunt_jax.api.train`'s result (a TrainResult or PopulationResult)."""
        trials = np.asarray([rec["val"]["sharpe"] for rec in result.history], np.float64)
        if isinstance(result, api.PopulationResult):
            per_bar = math.sqrt(result.trainer.trainer.market.bars_per_year)
            k = result.chosen
            selection = result.selections[k]
            return cls(result.test_evaluations[k], selection.epoch, int(result.state.epoch[0]),
                       selection.metric, selection.value, k, len(result.members),
                       trials / per_bar)
        per_bar = math.sqrt(result.trainer.market.bars_per_year)
        evaluation = result.trainer.evaluate_split(result.selected_agent, "test")
        return cls(evaluation, result.selection.epoch, int(result.state.epoch),
                   result.selection.metric, result.selection.value, None, 1, trials / per_bar)


def _day(t) -> str:
    return str(np.datetime64(t, "D"))


def stitch(evaluations: list[dict]) -> dict:
    """The folds' test portfolios chained: ``dates`` (every fold's dates, in order),
    ``curves`` name -> equity at those dates (each fold starts at the previous fold's final
    equity; flat across the gap between folds), ``random`` ``[P, ...]`` likewise for each
    random policy, and ``returns`` name -> the per-bar log returns of the folds' bars only
    (the gaps are not bars), ``random_returns`` ``[P, n]``."""
    names = ("agent",) + BASELINES
    dates, curves, returns = [], {n: [] for n in names}, {n: [] for n in names}
    rand, rand_returns, level = [], [], {n: 1.0 for n in names}
    rand_level = None
    for ev in evaluations:
        dates.append(np.asarray(ev["dates"]))
        for n in names:
            c = np.asarray(ev["curves"][n], np.float64)
            curves[n].append(level[n] * c / c[0])
            returns[n].append(np.diff(np.log(c)))
            level[n] = curves[n][-1][-1]
        r = np.asarray(ev["random_curves"], np.float64)
        rand_level = np.ones(len(r)) if rand_level is None else rand_level
        rand.append(rand_level[:, None] * r / r[:, :1])
        rand_returns.append(np.diff(np.log(r), axis=1))
        rand_level = rand[-1][:, -1]
    return {"dates": np.concatenate(dates),
            "curves": {n: np.concatenate(v) for n, v in curves.items()},
            "random": np.concatenate(rand, axis=1),
            "returns": {n: np.concatenate(v) for n, v in returns.items()},
            "random_returns": np.concatenate(rand_returns, axis=1)}


def curve_metrics(curve: np.ndarray, log_returns: np.ndarray, bars_per_year: float) -> dict:
    """Sharpe (annualized), total and annualized return, volatility and max drawdown of a
    stitched curve from its per-bar log returns (the trading metrics' definitions)."""
    mean, std = float(np.mean(log_returns)), float(np.std(log_returns))
    with np.errstate(over="ignore"):
        annual = float(np.expm1(bars_per_year * mean))
    return {"sharpe": float(sharpe_ratio(log_returns, bars_per_year).annualized),
            "total_return": float(curve[-1] / curve[0] - 1.0), "annualized_return": annual,
            "annualized_volatility": std * math.sqrt(bars_per_year),
            "max_drawdown": float(max_drawdowns(curve[None])[0]), "bars": int(log_returns.size)}


def stitched_report(results: list, bars_per_year: float, holding_bars: int,
                    draws: int = 2000) -> dict:
    """The walk-forward's JSON content from ``(fold, FoldResult)`` pairs."""
    s = stitch([r.evaluation for _, r in results])
    a = bars_per_year
    metrics = {n: curve_metrics(s["curves"][n], s["returns"][n], a) for n in s["curves"]}
    samples = [curve_metrics(c, r, a) for c, r in zip(s["random"], s["random_returns"])]
    sharpes = [m["sharpe"] for m in samples]
    agent_returns = s["returns"]["agent"]
    block = max(int(holding_bars), math.ceil(agent_returns.size ** (1 / 3)))
    ci = block_bootstrap_ci(agent_returns, lambda r: sharpe_ratio(r, a).annualized, block=block,
                            draws=draws, seed=0)
    # the candidates selection chose among: every epoch of every member of every fold, by
    # validation Sharpe (per bar), centred on its fold's mean so that V is the spread a
    # selection saw, not the difference between the folds' validation periods
    trials = np.concatenate([r.trial_sharpes - r.trial_sharpes.mean() for _, r in results])
    dsr = (deflated_sharpe_ratio(agent_returns, trials) if trials.size >= 2 else None)
    rows = []
    for fold, result in results:
        m = result.evaluation["metrics"]
        rows.append({**fold.to_json(), "selected_epoch": result.selected_epoch,
                     "epochs": result.epochs, "population": result.population,
                     "member": result.member,
                     f"validation_{result.select_metric}": result.select_value,
                     "test": {k: m["agent"][k] for k in ("sharpe", "total_return",
                                                        "max_drawdown", "bars")},
                     "test_buy_and_hold": {k: m["buy_and_hold"][k]
                                           for k in ("sharpe", "total_return")},
                     "agent_percentile_sharpe": m["agent_percentile"]["sharpe"]})
    return {
        "bars_per_year": a,
        "per_fold": rows,
        "out_of_sample": {
            **metrics,
            "random": {"policies": len(samples),
                       **{f"p{q}": float(np.percentile(sharpes, q)) for q in PERCENTILES}},
            "agent_percentile_sharpe": beat_percentile(metrics["agent"]["sharpe"], samples,
                                                       "sharpe"),
            "sharpe_bootstrap_95": {"low": ci.low, "high": ci.high, "block": block,
                                    "draws": draws},
            "deflated_sharpe": None if dsr is None else {
                "probability": dsr.probability, "n_trials": int(trials.size),
                "expected_max_sharpe_annualized": dsr.expected_max * math.sqrt(a)},
        },
        "curve": {"dates": [str(np.datetime64(d, "s")) for d in s["dates"]],
                  **{n: c for n, c in s["curves"].items()},
                  **{f"random_p{q}": np.percentile(s["random"], q, axis=0)
                     for q in PERCENTILES}},
    }


def _member_text(row: dict) -> str:
    """``k/P`` for a population's chosen member, ``-`` for a single agent."""
    member = row.get("member")
    return "-" if member is None else f"{member}/{row.get('population', 1)}"


def summary_table(report: dict) -> str:
    """The per-fold table and the out-of-sample lines, as text."""
    head = (f"{'fold':>4}  {'data from':<10}  {'validation':<10}  {'test from':<10}  "
            f"{'test to':<10}  {'member':>6}  {'epoch':>5}  {'sharpe':>7}  {'return':>8}  "
            f"{'B&H sh':>7}  {'pct':>5}")
    lines = ["walk-forward: selected agent of each fold on its test block (a population's: the "
             "member with the best validation Sharpe)", head,
             "-" * len(head)]
    for r in report["per_fold"]:
        lines.append(f"{r['fold']:>4}  {r['start'][:10]:<10}  {r['validation_start'][:10]:<10}  "
                     f"{r['test_start'][:10]:<10}  {r['test_end'][:10]:<10}  "
                     f"{_member_text(r):>6}  {r['selected_epoch']:>5}  {r['test']['sharpe']:>+7.2f}  "
                     f"{r['test']['total_return']:>+8.2%}  "
                     f"{r['test_buy_and_hold']['sharpe']:>+7.2f}  "
                     f"{r['agent_percentile_sharpe']:>5.1f}")
    o = report["out_of_sample"]
    ci, dsr = o["sharpe_bootstrap_95"], o["deflated_sharpe"]
    lines.append(f"out of sample ({o['agent']['bars']} bars): Sharpe {o['agent']['sharpe']:+.2f} "
                 f"(block bootstrap 95% [{ci['low']:+.2f}, {ci['high']:+.2f}], block "
                 f"{ci['block']}), return {o['agent']['total_return']:+.2%}; buy-and-hold "
                 f"Sharpe {o['buy_and_hold']['sharpe']:+.2f} return "
                 f"{o['buy_and_hold']['total_return']:+.2%}; random Sharpe 5-95% "
                 f"[{o['random']['p5']:+.2f}, {o['random']['p95']:+.2f}], agent beats "
                 f"{o['agent_percentile_sharpe']:.1f}%")
    if dsr is not None:
        lines.append(f"deflated Sharpe: {dsr['probability']:.3f} (N = {dsr['n_trials']} "
                     f"candidate epochs of every member over all folds; expected best of N by luck "
                     f"{dsr['expected_max_sharpe_annualized']:+.2f} annualized)")
    return "\n".join(lines)


def plot_walkforward(path: Path, report: dict) -> Path:
    """Stitched equity by date: agent, buy-and-hold, flat, the random 5-95% band; fold
    boundaries as vertical lines."""
    c = report["curve"]
    dates = np.asarray(c["dates"], "datetime64[s]")
    fig = Figure(figsize=(10, 5))
    ax = fig.subplots()
    ax.fill_between(dates, c["random_p5"], c["random_p95"], color="0.6", alpha=0.3, lw=0,
                    label="random policies, 5-95%")
    o = report["out_of_sample"]
    for name, style in (("agent", dict(color="C0", lw=1.6)), ("buy_and_hold", dict(color="C1")),
                        ("flat", dict(color="0.3", ls="--"))):
        ax.plot(dates, c[name], label=f"{name.replace('_', '-')} (Sharpe "
                                      f"{o[name]['sharpe']:+.2f})", **style)
    for r in report["per_fold"]:
        ax.axvline(np.datetime64(r["test_start"]), color="k", lw=0.6, alpha=0.5)
    ax.set_title(f"walk-forward, {report['folds']} folds ({report['window']}): out-of-sample "
                 "equity (fold boundaries marked)")
    ax.set_ylabel("equity")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return save_figure(fig, path)


__all__ = ["walkforward", "plan_folds", "fold_tables", "stitch", "stitched_report",
           "summary_table", "plot_walkforward", "curve_metrics", "Fold", "WINDOWS", "PLAN_FILE"]

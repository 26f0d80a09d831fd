"""``foxhunt-jax act``: the decision at the latest bar (or ``--at``) of a run or of an export.

A run directory decides through :class:`~foxhunt_jax.policy.policy.Policy`; an export folder
(``policy.json``) through its exported program (:mod:`foxhunt_jax.policy.standalone`), with the
features computed by this package (no code is loaded from the folder).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from foxhunt_jax.config import from_dict
from foxhunt_jax.data import features
from foxhunt_jax.data.loader import load_market
from foxhunt_jax.errors import ConfigError
from foxhunt_jax.files import write_atomic
from foxhunt_jax.policy import spec
from foxhunt_jax.policy.policy import (BAR_FIELDS, Policy, Position, check_position, describe,
                                       portfolio_of)
from foxhunt_jax.policy.standalone import ExportedPolicy, ExportError


def _load_bars(sources, cfg):
    # min_bars=1: an instrument too short for the warm-up gets spec.check_data's message
    return load_market(sources, sort=cfg.data.sort, synthetic=cfg.data.synthetic, min_bars=1)


def act(path: str | Path, data=None, at=None, agent: str = "selected",
        position: Position = Position(), member: int | None = None) -> tuple[list[dict], str]:
    """The decision records of every instrument (:func:`~foxhunt_jax.policy.policy.describe`)
    and a line naming the agent used. ``data``: sources (default: the run's own data).
    ``member``: of a population run, which member decides (:meth:`Policy.load`)."""
    path = Path(path)
    if (path / "policy.json").is_file():
        if member is not None:
            raise ConfigError(f"--member {member}: {path} is an exported policy (one agent)")
        return _act_export(path, data, at, position)
    policy = Policy.load(path, agent=agent, member=member)
    bars = _load_bars(data or list(policy.cfg.data.source), policy.cfg)
    tables = policy.bar_tables(bars, at)
    decision, _ = policy.start_bar(policy.inputs(tables), position)
    return policy.describe(decision, tables, position), policy.agent_note


def _act_export(path: Path, data, at, position: Position) -> tuple[list[dict], str]:
    try:
        exported = ExportedPolicy(path, features=features)
    except ExportError as err:
        raise ConfigError(str(err)) from None
    meta = exported.metadata
    cfg = from_dict(meta["config"])
    check_position(position, cfg.env.exposures)
    stats = {"feature_names": exported.feature_names, "norm_mean": exported.norm_mean,
             "norm_std": exported.norm_std, "data_columns": meta["data_columns"],
             "volume": meta.get("volume"),
             "instruments": meta["instruments"]}
    bars = _load_bars(data or list(cfg.data.source), cfg)
    tables = spec.tables_at(bars.instruments, at, stats, str(path))
    bar = {k: np.stack([t[k][-1] for t in tables]) for k in BAR_FIELDS}
    portfolio = {k: np.asarray(v) for k, v in
                 state_dict_portfolio(position, bar["close"]).items()}
    decision, _ = exported.decide(bar, portfolio)
    note = f"exported policy of {meta['run']} ({meta['agent']})"
    return describe(decision, tables, cfg.env, position, meta["instruments"], note), note


def state_dict_portfolio(position: Position, close) -> dict:
    """The env state of ``position`` as the export's portfolio dict."""
    pf = portfolio_of(position, np.asarray(close))
    return {f: getattr(pf, f) for f in pf.__dataclass_fields__}


def table(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The readable form: one row per instrument."""
    headers = ["instrument", "bar", "close", "exposure", "take-profit", "stop-loss",
               "Q exposure", "mean", "P(loss)"]
    rows = []
    for r in records:
        def barrier(x):
            if x is None:
                return "off"
            price = "-" if x["price"] is None else f"{x['price']:.4g}"
            return f"{x['sigma_multiple']:g}σ {price}"
        dist = r["return_distribution"]["exposure"]
        rows.append([r["instrument"], r["timestamp"], f"{r['close']:.4g}",
                     f"{r['exposure']:+g}", barrier(r["take_profit"]), barrier(r["stop_loss"]),
                     " ".join(f"{q:+.3f}" for q in r["q"]["exposure"]),
                     f"{dist['mean']:+.3f}", f"{dist['p_loss']:.0%}"])
    return headers, rows


def write_json(path: str | Path, payload) -> None:
    """Writes ``payload`` to ``path`` whole (a temporary file renamed into place)."""
    write_atomic(path, json.dumps(payload, indent=1))


__all__ = ["act", "table", "write_json"]

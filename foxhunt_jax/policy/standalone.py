"""Loads a foxhunt-jax policy export with jax and numpy only (the export's ``load_policy.py``).

    import load_policy                      # from the export folder
    policy = load_policy.load("path/to/export")
    bars = policy.bar_inputs(open, high, low, close, volume)   # one instrument's bars [n]
    decision, state = policy.decide(policy.stack([bars]))      # at its last bar, flat
    decision, state = policy.step(state, policy.stack([new_bars]))  # the next bar

Arrays are dicts: a bar holds ``features`` [N, F] and ``open``, ``high``, ``low``, ``close``,
``sigma`` [N] (N instruments); a decision holds ``action`` [N, B] (indices into the branches
of ``policy.actions``), ``q`` (per branch [N, n_d] expected Q), ``mean`` and ``p_loss`` [N, B]
(the chosen action's expected Q and probability of a negative return), ``equity`` [N], ``after``
(the portfolio once the action has filled at the close, a preview under next-open fills:
``tp_price``, ``sl_price``, ...),
``barrier`` and ``terminated`` [N]. The portfolio starts flat with equity 1 unless given.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import numpy as np

FORMAT_VERSION = 1


class ExportError(ValueError):
    """An export folder this loader cannot use; the message is one line."""


def _features_module(folder: Path):
    """The export's ``features.py`` (the feature code the network was trained with)."""
    spec = importlib.util.spec_from_file_location("foxhunt_policy_features", folder / "features.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nest(flat: dict) -> dict:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}``."""
    tree: dict = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


class ExportedPolicy:
    """An export folder's decision and step functions with their parameters and statistics."""

    def __init__(self, folder: str | Path, features=None):
        folder = Path(folder)
        meta_path = folder / "policy.json"
        if not meta_path.is_file():
            raise ExportError(f"{folder} is not a policy export (no policy.json)")
        try:
            meta = json.loads(meta_path.read_text())
            version = int(meta["format_version"])
        except (ValueError, KeyError, TypeError):
            raise ExportError(f"{meta_path}: unreadable policy metadata") from None
        if version > FORMAT_VERSION:
            raise ExportError(f"{folder}: export format version {version} is newer than this "
                              f"loader reads ({FORMAT_VERSION}); use the load_policy.py of a "
                              "newer foxhunt-jax")
        self.folder, self.meta = folder, meta
        self.metadata = meta["metadata"]
        self.actions = meta["actions"]["branches"]
        self.feature_names = meta["features"]["names"]
        self.warmup = int(meta["features"]["warmup"])
        self.norm_mean = np.asarray(meta["normalization"]["mean"], np.float32)
        self.norm_std = np.asarray(meta["normalization"]["std"], np.float32)
        self._int_fields = set(meta["portfolio"]["int_fields"])
        self._portfolio_fields = meta["portfolio"]["fields"]
        with np.load(folder / "params.npz", allow_pickle=False) as z:
            self.params = _nest({k: jax.numpy.asarray(z[k]) for k in z.files})
        self._features = features
        programs = {}
        for name in ("decide", "step"):
            exp = jax.export.deserialize(bytearray((folder / f"{name}.jax_exported").read_bytes()))
            programs[name] = jax.jit(exp.call)
        self._decide, self._step = programs["decide"], programs["step"]

    def bar_inputs(self, open, high, low, close, volume=None) -> dict:  # noqa: A002
        """One instrument's bars [n] (oldest first) -> its decidable bars from bar ``warmup``
        on: ``features`` [n - warmup, F] normalized, ``open`` ... ``sigma`` float32."""
        if self._features is None:
            self._features = _features_module(self.folder)
        f = self._features
        cols = {k: np.asarray(v, np.float64) for k, v in
                (("open", open), ("high", high), ("low", low), ("close", close))}
        cols["volume"] = (np.zeros_like(cols["close"]) if volume is None
                          else np.asarray(volume, np.float64))
        if cols["close"].shape[0] <= self.warmup:
            raise ExportError(f"{cols['close'].shape[0]} bars: a decision needs at least "
                              f"{self.warmup + 1} ({self.warmup} bars of feature warm-up)")

        class Bars:
            pass
        bars = Bars()
        for k, v in cols.items():
            setattr(bars, k, v)
        with np.errstate(divide="ignore", invalid="ignore"):
            raw = f.instrument_features(bars)[self.warmup:]
            sigma = f.rolling_sigma(cols["close"])[self.warmup:]
        out = {"features": f.normalize(raw, self.norm_mean, self.norm_std),
               "sigma": sigma.astype(np.float32)}
        for k in ("open", "high", "low", "close"):
            out[k] = cols[k][self.warmup:].astype(np.float32)
        return out

    @staticmethod
    def stack(tables: list[dict], row: int = -1) -> dict:
        """Row ``row`` of each instrument's :meth:`bar_inputs`, stacked into one bar [N]."""
        return {k: np.stack([t[k][row] for t in tables]) for k in tables[0]}

    def flat_portfolio(self, n: int) -> dict:
        """A flat portfolio of equity 1 for ``n`` instruments (the env's fresh state)."""
        ones = {"equity", "cash"}
        return {k: (np.zeros((n,), np.int32) if k in self._int_fields else
                    np.full((n,), 1.0 if k in ones else 0.0, np.float32))
                for k in self._portfolio_fields}

    def decide(self, bar: dict, portfolio: dict | None = None) -> tuple[dict, dict]:
        """The decision at ``bar`` [N] for ``portfolio`` (default flat) and the live state."""
        n = np.asarray(bar["close"]).shape[0]
        return self._decide(self.params, bar, portfolio or self.flat_portfolio(n))

    def step(self, state: dict, new_bar: dict) -> tuple[dict, dict]:
        """The env's step to ``new_bar`` [N] with the pending action, then its decision."""
        return self._step(self.params, state, new_bar)


def load(folder: str | Path) -> ExportedPolicy:
    return ExportedPolicy(folder)

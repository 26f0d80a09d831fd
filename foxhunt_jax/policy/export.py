"""A self-contained export of a trained policy: ``foxhunt-jax export --run DIR --out DIR2``.

The folder holds:

- ``decide.jax_exported``, ``step.jax_exported``: :func:`~foxhunt_jax.policy.policy.start_at`
  and :func:`~foxhunt_jax.policy.policy.step_from` serialized with ``jax.export`` (StableHLO,
  lowered for CPU and CUDA, any number of instruments), with dicts of arrays in and out;
- ``params.npz``: the network parameters (keys ``params/trunk_0/kernel``, ...);
- ``policy.json``: format version, metadata (config digest, the run's config, data columns,
  created time, package version, epoch), the normalization statistics, the feature
  specification (names, warm-up) and the action specification (branches and their values);
- ``features.py``: the built-in feature functions of :mod:`foxhunt_jax.data.features`, copied
  from their source (NumPy only), and the run's feature names, so the export computes the
  features its network was trained on (a run with user features cannot be exported: their
  code is not the package's to copy);
- ``load_policy.py``: the loader (:mod:`foxhunt_jax.policy.standalone`), needing only jax and
  numpy.

The exported functions use the ``"xla"`` backend of the network forward (the Flax layers; a
Pallas kernel lowers for one platform only) and map it over the instruments, so the batch is
symbolic.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import json
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from foxhunt_jax.version import __version__
from foxhunt_jax.backend import make as make_backend
from foxhunt_jax.config import to_dict
from foxhunt_jax.data import features
from foxhunt_jax.env import trading
from foxhunt_jax.errors import ConfigError
from foxhunt_jax.policy import standalone
from foxhunt_jax.policy.policy import (BAR_FIELDS, BarInputs, Core, Decision, Policy, PolicyState,
                                       config_digest, decision_dict, start_at, state_dict,
                                       step_from)

FORMAT_VERSION = standalone.FORMAT_VERSION
PLATFORMS = ("cpu", "cuda")
PORTFOLIO_FIELDS = tuple(f.name for f in dataclasses.fields(trading.EnvState))
# the feature code copied into the export, in dependency order
FEATURE_CONSTANTS = ("WARMUP", "SIGMA_WINDOW", "SIGMA_FLOOR", "CLIP", "_CHUNK")
FEATURE_FUNCTIONS = (features._rolling, features._mean, features._std, features._max,
                     features._min, features._lag, features._safe_div, features.log_returns,
                     features.rolling_sigma, features.builtin_columns, features.normalize)
# the export's entry point: the run's features (FEATURE_NAMES) of one instrument's bars
INSTRUMENT_FEATURES = '''def instrument_features(bars):
    """Raw features FEATURE_NAMES of one instrument: [n] bars -> [n, F] float64."""
    cols = builtin_columns(bars)
    return np.stack([cols[name] for name in FEATURE_NAMES], axis=1)
'''


def _bar(d: dict) -> BarInputs:
    return BarInputs(**{k: d[k] for k in BAR_FIELDS})


def _portfolio(d: dict) -> trading.EnvState:
    return trading.EnvState(**{k: d[k] for k in PORTFOLIO_FIELDS})


def _out(decision: Decision, state: PolicyState) -> tuple[dict, dict]:
    return decision_dict(decision), state_dict(state)


def exported_functions(core: Core):
    """``decide(params, bar, portfolio)`` and ``step(params, state, new_bar)`` over dicts."""
    def decide(params, bar, portfolio):
        return _out(*start_at(core, params, _bar(bar), _portfolio(portfolio), per_row=True))

    def step(params, state, new_bar):
        st = PolicyState(portfolio=_portfolio(state["portfolio"]), bar=_bar(state["bar"]),
                         action=state["action"])
        return _out(*step_from(core, params, st, _bar(new_bar), per_row=True))

    return decide, step


def _specs(n, num_features: int, num_branches: int) -> tuple[dict, dict, dict]:
    sds = jax.ShapeDtypeStruct
    bar = {k: sds((n, num_features) if k == "features" else (n,), jnp.float32)
           for k in BAR_FIELDS}
    ints = ("bar", "step", "time_in_trade")
    portfolio = {k: sds((n,), jnp.int32 if k in ints else jnp.float32) for k in PORTFOLIO_FIELDS}
    state = {"portfolio": portfolio, "bar": bar, "action": sds((n, num_branches), jnp.int32)}
    return bar, portfolio, state


def flat_params(params) -> dict[str, np.ndarray]:
    """The parameter tree as ``{"params/trunk_0/kernel": array, ...}``."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
            for path, v in leaves}


def feature_source(names) -> str:
    """The NumPy feature code of :mod:`foxhunt_jax.data.features` computing the built-in
    features ``names`` as one module's text."""
    head = ['"""Bar features of a foxhunt-jax policy export (copied from foxhunt_jax.data.features'
            ' by the export; NumPy only)."""', "", "from __future__ import annotations", "",
            "import numpy as np", ""]
    consts = [f"FEATURE_NAMES = {tuple(names)!r}"]
    consts += [f"{name} = {getattr(features, name)!r}" for name in FEATURE_CONSTANTS]
    funcs = [inspect.getsource(f) for f in FEATURE_FUNCTIONS] + [INSTRUMENT_FEATURES]
    return "\n".join(head + consts) + "\n\n\n" + "\n\n".join(funcs)


def action_spec(env_cfg) -> dict:
    branches = [{"name": "exposure", "values": list(env_cfg.exposures)}]
    for name in ("take_profit", "stop_loss"):
        values = getattr(env_cfg, name)
        if values:
            branches.append({"name": name, "values": list(values), "unit": "sigma"})
    return {"branches": branches}


def export_policy(policy: Policy, out_dir: str | Path) -> Path:
    """Writes the export folder of ``policy`` to ``out_dir`` (which must not hold files);
    the folder appears whole or not at all."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} already exists and is not an empty folder")
    names = list(policy.stats["feature_names"])
    user = [name for name in names if not features.feature(name).builtin]
    if user:
        raise ConfigError(f"{policy.run_dir} uses user features {user}: an export carries "
                          "built-in features only (their code is copied into it)")
    core = dataclasses.replace(policy.core, backend=make_backend("xla", policy.core.backend.tuning))
    decide, step = exported_functions(core)
    (n,) = jax.export.symbolic_shape("n")
    bar, portfolio, state = _specs(n, len(names), len(policy.cfg.env.branch_sizes))
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), policy.params)
    # keep_unused: every input stays an argument (the step reads no feature of the old bar)
    def export(f):
        return jax.export.export(jax.jit(f, keep_unused=True), platforms=PLATFORMS)

    programs = {"decide": export(decide)(params, bar, portfolio),
                "step": export(step)(params, state, bar)}
    cfg = policy.cfg
    meta = {
        "format_version": FORMAT_VERSION,
        "metadata": {"config_digest": config_digest(cfg), "config": to_dict(cfg),
                     "data_columns": policy.stats["data_columns"],
                     "volume": policy.stats.get("volume"),
                     "instruments": policy.stats.get("instruments", []),
                     "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                     "package_version": __version__, "run": str(policy.run_dir),
                     "epoch": policy.epoch, "agent": policy.agent_note,
                     "platforms": list(PLATFORMS)},
        "normalization": {"mean": policy.stats["norm_mean"], "std": policy.stats["norm_std"]},
        "features": {"names": names, "warmup": features.WARMUP,
                     "bar_fields": list(BAR_FIELDS), "module": "features.py"},
        "actions": action_spec(cfg.env),
        "portfolio": {"fields": list(PORTFOLIO_FIELDS),
                      "int_fields": ["bar", "step", "time_in_trade"]},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name, exp in programs.items():
            (tmp / f"{name}.jax_exported").write_bytes(exp.serialize())
        np.savez(tmp / "params.npz", **flat_params(policy.params))
        (tmp / "policy.json").write_text(json.dumps(meta, indent=1))
        (tmp / "features.py").write_text(feature_source(names))
        shutil.copyfile(inspect.getsourcefile(standalone), tmp / "load_policy.py")
        tmp.chmod(0o755)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


__all__ = ["export_policy", "exported_functions", "feature_source", "flat_params",
           "action_spec", "FORMAT_VERSION", "PLATFORMS"]

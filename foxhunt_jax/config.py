"""Typed configuration: one place where every setting is declared, parsed and validated.

A :class:`Config` is a tree of frozen dataclasses. It is built from defaults, then a YAML file
(``configs/*.yaml``, read with ``yaml.safe_load``), then dotted overrides (``--set a.b=v``).
Unknown keys and bad values raise :class:`~foxhunt_jax.errors.ConfigError` with a one-line
message naming the key. ``validate`` is the only place that checks ranges.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.resources
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from foxhunt_jax.data.features import DEFAULT_FEATURES, parse_split_dates, resolve_features
from foxhunt_jax.errors import ConfigError

# the configs shipped with the package: the repository's top-level configs/, which the package
# holds as foxhunt_jax/configs (a link in a checkout, the files themselves in a wheel)
CONFIG_DIR = Path(str(importlib.resources.files("foxhunt_jax") / "configs"))
# Seeds the PRNGs take alike: jax.random.key gives the same key with and without x64 only for
# 0 .. 2**32 - 1 (it wraps or refuses others), and NumPy's default_rng refuses negative seeds.
SEED_RANGE = (0, 2**32 - 1)
INT_LIMIT = 2**31 - 1  # every other integer key reaches the jitted programs as an int32


def setting(default: Any = dataclasses.MISSING, meaning: str = "", *,
            factory: Any = dataclasses.MISSING) -> Any:
    """A config field with its one-line meaning (``metadata["meaning"]``), the one source of the
    text ``foxhunt-jax config show`` and ``config keys`` print."""
    return field(default=default, default_factory=factory, metadata={"meaning": meaning})


@dataclass(frozen=True)
class SyntheticConfig:
    """Parameters of ``builtin:synthetic`` (see :mod:`foxhunt_jax.data.synthetic`)."""

    instruments: int = setting(4, "number of instruments generated")
    bars: int = setting(3000, "bars per instrument")
    signal_strength: float = setting(
        0.3, "lag-1 autocorrelation of the log returns (the planted AR(1) signal; 0 = none)")
    volatility: float = setting(0.01, "standard deviation of the one-bar log returns")
    seed: int = setting(0, "seed of the generator")


@dataclass(frozen=True)
class DataConfig:
    source: tuple[str, ...] = setting(("builtin:us_stocks_daily",),
                                      "market data: CSV/Parquet paths or builtin:NAME")
    # one calendar boundary for every instrument (foxhunt_jax.data.features.split_boundaries)
    splits: tuple[float, float, float] = setting(
        (0.70, 0.15, 0.15), "train, validation, test fractions of the distinct bar times of all "
                            "instruments pooled, by time")
    split_dates: tuple[str, ...] = setting(
        (), "[validation_start, test_start] (ISO dates or times) in place of the fractions; "
            "[] = unset")
    # the market a walk-forward fold sees (foxhunt_jax.data.loader.window_market)
    window: tuple[str, ...] = setting(
        (), "[start, end] (ISO dates or times): load only bars with start <= time < end; "
            "[] = every bar")
    sort: bool = setting(False, "sort unsorted timestamps instead of rejecting the file")
    # shapes only (env/trading.make_params); a walk-forward sets its largest fold's rows
    min_table_rows: int = setting(
        0, "pad the market tables to at least this many rows (shapes only); 0 = next power of 2")
    synthetic: SyntheticConfig = setting(factory=SyntheticConfig,
                                         meaning="the builtin:synthetic market")
    # resolved by validate into the names (docs/features.md)
    features: tuple[str, ...] = setting(
        DEFAULT_FEATURES, "market feature columns in order: built-in or registered names, or "
                          "patterns like vol_* (docs/features.md)")


FILLS = ("next_open", "close")  # env.fill values
MAX_TABLE_ROWS = 1 << 24  # data.min_table_rows: a bound on what padding may allocate


@dataclass(frozen=True)
class EnvConfig:
    # every other key of this section configures the trading env only, except episode_length
    # (docs/agent.md: "Any gymnax environment")
    name: str = setting("trading", "the environment: trading, or a gymnax id such as "
                                   "CartPole-v1 (needs the gymnax extra)")
    episode_length: int = setting(100, "L: steps of an episode before it is truncated (a "
                                       "gymnax env: steps collected per episode an epoch)")
    exposures: tuple[float, ...] = setting(
        (-1.0, -0.5, 0.0, 0.5, 1.0), "branch 0: target exposures, signed fractions of equity")
    take_profit: tuple[float, ...] = setting(
        (1.0, 2.0, 3.0), "branch 1: take-profit distances in multiples of sigma; [] = off")
    stop_loss: tuple[float, ...] = setting(
        (1.0, 2.0, 3.0), "branch 2: stop-loss distances in multiples of sigma; [] = off")
    time_barrier: int = setting(20, "H: bars a position may be held before it is closed")
    cost_bps: float = setting(2.0, "commission + half-spread, basis points of traded notional")
    fill: str = setting("next_open", "where a decision at bar t's close fills: next_open (bar "
                                     "t+1's open) or close (bar t's close, optimistic)")
    slippage_bps: float = setting(0.0, "every fill price moved against the trade by this many "
                                       "basis points")
    fixed_cost: float = setting(0.0, "cost per trade, in units of initial equity")
    ruin_floor: float = setting(0.5, "episode ends when equity < ruin_floor * initial equity")
    reward_scale: float = setting(100.0, "reward = reward_scale * log(equity change)")

    @property
    def branch_sizes(self) -> tuple[int, ...]:
        return tuple(len(v) for v in (self.exposures, self.take_profit, self.stop_loss) if v)


@dataclass(frozen=True)
class NetworkConfig:
    trunk: tuple[int, ...] = setting((256, 256), "widths of the shared trunk's hidden layers")
    head: int = setting(160, "hidden width of the value stream and of each advantage stream")
    atoms: int = setting(11, "C51 atoms of each return distribution")
    # auto: the trainer derives [v_min, v_max] from the training split's returns
    # (foxhunt_jax.agent.value_range) and the run's config.yaml records them as explicit
    support: str = setting("auto", "the C51 support: auto (from the returns the env produces) or "
                                   "explicit (v_min, v_max as given)")
    v_min: float = setting(-10.0, "lowest atom of the support (network.support=explicit)")
    v_max: float = setting(10.0, "highest atom of the support (network.support=explicit)")
    # auto is resolved once per run, on its device (foxhunt_jax.backend.resolve_config), and the
    # run's config.yaml records the result
    dtype: str = setting("auto", "matrix inputs: float32, bfloat16 (params and logits stay f32) "
                                 "or auto (bfloat16 on a CUDA GPU, else float32)")
    # pallas: the whole trading rollout in one kernel (pallas_kernels/rollout.py) and the fused
    # Q-forward, bfloat16 only (the float32 kernel loses to XLA, docs/performance.md),
    # interpreted (slowly) off CUDA GPUs; resolved once by foxhunt_jax.backend.resolve.
    # Training always uses the Flax layers.
    backend: str = setting("auto", "collection/validation/inference: xla, pallas, or auto "
                                   "(pallas on a CUDA GPU with bfloat16, else xla)")


@dataclass(frozen=True)
class ReplayConfig:
    capacity: int = setting(1 << 17, "transitions the prioritized replay buffer holds")
    alpha: float = setting(0.6, "priority exponent; 0 gives uniform sampling")
    beta_start: float = setting(0.4, "importance-sampling exponent at the first epoch")
    beta_end: float = setting(1.0, "importance-sampling exponent at the last epoch")
    priority_eps: float = setting(1e-6, "added to every priority so none is zero")


@dataclass(frozen=True)
class CuriosityConfig:
    coef: float = setting(0.01, "weight of the novelty bonus in the reward; 0 = curiosity off")
    hidden: int = setting(128, "hidden width of the novelty networks")
    embed: int = setting(32, "embedding width of the novelty networks")
    learning_rate: float = setting(1e-4, "Adam learning rate of the novelty predictor")
    # bf16x3 keeps the novelty's relative error near 1e-5 (1e-3 late in a run); its speed is in
    # docs/performance.md. The predictor's update at the learner's batch always multiplies in
    # true f32 (docs/replay.md)
    precision: str = setting("auto", "novelty GEMMs: float32, bf16x3 (three bf16 products), or "
                                     "auto (bf16x3 when network.dtype is bfloat16)")


@dataclass(frozen=True)
class TrainConfig:
    seed: int = setting(0, "seed of every random draw of the run")
    epochs: int = setting(30, "epochs to train (a resume may raise it)")
    num_episodes: int = setting(256, "N: episodes collected in parallel per epoch")
    train_steps: int = setting(50, "K: learner steps per epoch")
    batch_size: int = setting(64, "M: transitions per learner step")
    learning_rate: float = setting(1e-4, "Adam learning rate")
    adam_eps: float = setting(1e-8, "Adam epsilon")
    max_grad_norm: float = setting(10.0, "gradients are clipped to this global norm")
    gamma: float = setting(0.99, "discount per step")
    n_step: int = setting(1, "steps of the n-step return (1..5)")
    target_update: str = setting("hard", "target network: hard (copy every target_period "
                                         "steps) or polyak")
    target_period: int = setting(200, "learner steps between hard target copies")
    polyak_tau: float = setting(0.005, "polyak averaging rate of the target network")
    epsilon_start: float = setting(1.0, "exploration rate at the first epoch")
    epsilon_end: float = setting(0.05, "exploration rate after the decay")
    epsilon_decay_epochs: int = setting(20, "epochs of linear epsilon decay")
    validation_windows: int = setting(64, "fixed validation windows walked greedily each epoch "
                                          "(a gymnax env: greedy episodes from fixed resets)")
    # foxhunt_jax.training.selection
    select_by: str = setting("sharpe", "validation metric that selects the agent: sharpe, "
                                       "total_return or loss (trading); return (a gymnax env)")
    patience: int = setting(0, "stop after this many epochs without a better select_by; 0 = off")
    checkpoint_every: int = setting(1, "epochs between checkpoints (the last one always)")
    log_every: int = setting(1, "epochs between printed epoch lines (the last one always)")
    # S, not the device count, defines the results (foxhunt_jax.parallel)
    shards: int = setting(1, "S: episodes, replay and batch split into S shards, placed on "
                             "the local devices whose count divides S")
    # same numbers; the cost is a fourth program to compile (the gain is in docs/performance.md)
    pair_rollouts: bool = setting(True, "with network.backend=pallas on one device, queued "
                                        "epochs run Validation and the next Experience as one "
                                        "program")
    # foxhunt_jax.training.phases.overlapped; the staleness is in docs/training.md ("Overlap")
    overlap: bool = setting(False, "each epoch's Training runs beside the next epoch's "
                                   "collection, which acts with the agent one epoch stale")
    # P > 1: foxhunt_jax.training.population (docs/population.md)
    population: int = setting(1, "P: agents trained in one program; member i has seed "
                                 "train.seed + i (docs/population.md)")


@dataclass(frozen=True)
class EvalConfig:
    """The full-split evaluation of the final report and ``evaluate``."""

    # the agent's exploration draw, the same costs, walked beside the agent in one program
    random_policies: int = setting(200, "random policies whose 5th, 50th and 95th percentiles "
                                        "of every metric the reports give")


# the keys a population may vary across members (docs/population.md says how each is traced)
POPULATION_KEYS = ("train.learning_rate", "train.gamma", "train.n_step", "train.epsilon_start",
                   "train.epsilon_end", "train.epsilon_decay_epochs", "curiosity.coef",
                   "env.cost_bps")


@dataclass(frozen=True)
class PopulationConfig:
    """Per-member hyperparameters of a population (``train.population`` > 1)."""

    grid: tuple[str, ...] = setting(
        (), "KEY=V1,V2,... entries; member i takes cell i mod G of their G-cell product")
    random: tuple[str, ...] = setting(
        (), "KEY=LOW..HIGH[:log] entries; each member draws KEY uniformly (or log-uniformly)")
    seed: int = setting(0, "seed of the population.random draws")


@dataclass(frozen=True)
class Config:
    data: DataConfig = setting(factory=DataConfig, meaning="market data and its splits")
    env: EnvConfig = setting(factory=EnvConfig,
                             meaning="the environment: the trading env and its settings, or a "
                                     "gymnax env")
    network: NetworkConfig = setting(factory=NetworkConfig,
                                     meaning="the distributional branching dueling Q-network")
    replay: ReplayConfig = setting(factory=ReplayConfig, meaning="prioritized replay")
    curiosity: CuriosityConfig = setting(factory=CuriosityConfig,
                                         meaning="random-network-distillation novelty bonus")
    train: TrainConfig = setting(factory=TrainConfig, meaning="the training loop")
    eval: EvalConfig = setting(factory=EvalConfig, meaning="the final report and evaluate")
    population: PopulationConfig = setting(factory=PopulationConfig,
                                           meaning="per-member hyperparameters of "
                                                   "train.population")


# ---------------------------------------------------------------------------------------------
# Building a config from YAML mappings and dotted overrides


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Converts a YAML value to the annotated type ``tp`` or raises ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
        return _build(tp, value, key + ".")
    if origin is tuple:
        args = typing.get_args(tp)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' must be a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"config key '{key}' needs {len(args)} values, got {len(value)}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"config key '{key}' must be an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"config key '{key}' must be an integer, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"config key '{key}' must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"config key '{key}' must be a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, datetime.date):  # YAML reads an unquoted ISO date as a date
            return value.isoformat()
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"config key '{key}' must be a string, got {value!r}")
        return str(value)
    raise TypeError(f"unsupported config type {tp} at {key}")  # a bug in this module


def _build(cls: type, mapping: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in mapping:
        if k not in names:
            raise ConfigError(f"unknown config key '{prefix}{k}' (known: {', '.join(sorted(names))})")
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in mapping.items()}
    return cls(**kwargs)


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def to_dict(cfg: Any) -> dict:
    """Plain nested dict (tuples as lists) for YAML/JSON output; any other value likewise."""

    def conv(x):
        if dataclasses.is_dataclass(x):
            return {f.name: conv(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, tuple):
            return [conv(v) for v in x]
        return x

    return conv(cfg)


def parse_override(text: str) -> dict:
    """``"a.b=v"`` -> ``{"a": {"b": v}}`` with ``v`` parsed as YAML (so 3, 0.5, [1, 2] work)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key.path=value")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    out: dict = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def read_yaml(path: str | Path) -> dict:
    """Reads a YAML mapping with the safe loader (no object construction)."""
    p = Path(path)
    if p.exists() and not p.is_file():  # a FIFO would block, a device never end
        raise ConfigError(f"config file {p} is not a regular file")
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {p}{where}: invalid YAML") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping at the top level")
    return data


def resolve_config_path(name: str | Path) -> Path:
    """A path as given, else a name like ``smoke`` (or ``configs/smoke.yaml``) looked up among
    the configs the package ships (:data:`CONFIG_DIR`)."""
    p = Path(name)
    if p.exists():
        return p
    candidate = CONFIG_DIR / (p.name if p.suffix else p.name + ".yaml")
    if candidate.exists():
        return candidate
    raise ConfigError(f"config file {name} does not exist")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file <- dotted overrides, then :func:`validate`."""
    mapping: dict = {}
    if path is not None:
        mapping = read_yaml(resolve_config_path(path))
    for text in overrides:
        mapping = _merge(mapping, parse_override(text))
    return validate(_build(Config, mapping))


def from_dict(mapping: dict) -> Config:
    return validate(_build(Config, mapping))


def replace(cfg: Config, **sections: dict) -> Config:
    """``replace(cfg, train={"epochs": 3})``: a validated copy with some fields changed."""
    return from_dict(_merge(to_dict(cfg), sections))


def _check(ok: bool, key: str, rule: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}' {rule}, got {value!r}")


def _values_of(node: Any, kind: type, key: str = ""):
    """(dotted key, value) of every field of type ``kind`` under the dataclass ``node``, the
    items of tuples included."""
    hints = typing.get_type_hints(type(node))
    for f in dataclasses.fields(node):
        value, tp, name = getattr(node, f.name), hints[f.name], f"{key}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _values_of(value, kind, name + ".")
        elif tp is kind:
            yield name, value
        elif typing.get_origin(tp) is tuple and kind in typing.get_args(tp):
            yield from ((f"{name}[{i}]", v) for i, v in enumerate(value) if type(v) is kind)



def validate(cfg: Config) -> Config:
    """Every range check lives here. Returns ``cfg`` with ``data.features`` resolved to names
    (patterns expanded) or raises ConfigError."""
    for key, value in _values_of(cfg, float):
        _check(math.isfinite(value), key, "must be a finite number", value)
    seeds = ("train.seed", "data.synthetic.seed", "population.seed")
    for key, value in _values_of(cfg, int):
        low, high = SEED_RANGE if key in seeds else (-INT_LIMIT, INT_LIMIT)
        what = "the PRNG's seed range" if key in seeds else "a 32-bit integer, as programs hold it"
        _check(low <= value <= high, key, f"must be an integer in {low}..{high} ({what})", value)
    d, e, n, r, c, t = cfg.data, cfg.env, cfg.network, cfg.replay, cfg.curiosity, cfg.train
    _check(len(d.source) >= 1, "data.source", "needs at least one path or builtin:NAME", d.source)
    _check(all(x > 0 for x in d.splits) and abs(sum(d.splits) - 1) < 1e-6, "data.splits",
           "must be three positive fractions summing to 1", d.splits)
    if d.split_dates:
        parse_split_dates(d.split_dates)
    if d.window:
        parse_split_dates(d.window, "data.window", ("start", "end"))
    _check(0 <= d.min_table_rows <= MAX_TABLE_ROWS, "data.min_table_rows",
           f"must be in 0..{MAX_TABLE_ROWS}", d.min_table_rows)
    s = d.synthetic
    _check(s.instruments >= 1, "data.synthetic.instruments", "must be >= 1", s.instruments)
    _check(s.bars >= 200, "data.synthetic.bars", "must be >= 200", s.bars)
    _check(0 <= s.signal_strength < 1, "data.synthetic.signal_strength", "must be in [0, 1)",
           s.signal_strength)
    _check(s.volatility > 0, "data.synthetic.volatility", "must be > 0", s.volatility)
    features = resolve_features(d.features, "config key 'data.features'")

    _check(bool(e.name.strip()), "env.name", "must be trading or a gymnax id", e.name)
    _check(e.episode_length >= 1, "env.episode_length", "must be >= 1", e.episode_length)
    _check(len(e.exposures) >= 2, "env.exposures", "needs at least two values", e.exposures)
    _check(all(-1 <= x <= 1 for x in e.exposures), "env.exposures", "values must be in [-1, 1]",
           e.exposures)
    for name in ("take_profit", "stop_loss"):
        vals = getattr(e, name)
        _check(all(v > 0 for v in vals), f"env.{name}", "values must be > 0", vals)
    _check(e.time_barrier >= 1, "env.time_barrier", "must be >= 1", e.time_barrier)
    _check(e.cost_bps >= 0, "env.cost_bps", "must be >= 0", e.cost_bps)
    _check(e.fill in FILLS, "env.fill", f"must be {' or '.join(FILLS)}", e.fill)
    _check(0 <= e.slippage_bps < 1e4, "env.slippage_bps", "must be in [0, 10000)",
           e.slippage_bps)
    _check(e.fixed_cost >= 0, "env.fixed_cost", "must be >= 0", e.fixed_cost)
    _check(0 < e.ruin_floor < 1, "env.ruin_floor", "must be in (0, 1)", e.ruin_floor)
    _check(e.reward_scale > 0, "env.reward_scale", "must be > 0", e.reward_scale)

    _check(len(n.trunk) >= 1 and all(w >= 1 for w in n.trunk), "network.trunk",
           "needs one or more positive widths", n.trunk)
    _check(n.head >= 1, "network.head", "must be >= 1", n.head)
    _check(n.atoms >= 2, "network.atoms", "must be >= 2", n.atoms)
    _check(n.support in ("auto", "explicit"), "network.support", "must be auto or explicit",
           n.support)
    _check(n.v_min < n.v_max, "network.v_max", "must be greater than network.v_min", n.v_max)
    placeholder = tuple(NetworkConfig.__dataclass_fields__[k].default for k in ("v_min", "v_max"))
    _check(n.support == "explicit" or (n.v_min, n.v_max) == placeholder, "network.v_min",
           "and network.v_max are used only with network.support=explicit (auto derives them)",
           (n.v_min, n.v_max))
    _check(n.dtype in ("auto", "float32", "bfloat16"), "network.dtype",
           "must be auto, float32 or bfloat16", n.dtype)
    _check(n.backend in ("auto", "xla", "pallas"), "network.backend",
           "must be auto, xla or pallas", n.backend)
    _check(n.backend != "pallas" or n.dtype != "float32", "network.backend",
           "pallas needs network.dtype=bfloat16 (its float32 kernel is slower than XLA)",
           n.backend)

    _check(r.capacity >= t.batch_size, "replay.capacity", "must be >= train.batch_size", r.capacity)
    _check(r.alpha >= 0, "replay.alpha", "must be >= 0", r.alpha)
    _check(0 <= r.beta_start <= 1, "replay.beta_start", "must be in [0, 1]", r.beta_start)
    _check(0 <= r.beta_end <= 1, "replay.beta_end", "must be in [0, 1]", r.beta_end)
    _check(r.priority_eps > 0, "replay.priority_eps", "must be > 0", r.priority_eps)

    _check(c.coef >= 0, "curiosity.coef", "must be >= 0", c.coef)
    _check(c.hidden >= 1 and c.embed >= 1, "curiosity.hidden", "and curiosity.embed must be >= 1",
           (c.hidden, c.embed))
    _check(c.learning_rate > 0, "curiosity.learning_rate", "must be > 0", c.learning_rate)
    _check(c.precision in ("auto", "float32", "bf16x3"), "curiosity.precision",
           "must be auto, float32 or bf16x3", c.precision)

    _check(t.epochs >= 1, "train.epochs", "must be >= 1", t.epochs)
    _check(t.num_episodes >= 1, "train.num_episodes", "must be >= 1", t.num_episodes)
    _check(t.train_steps >= 0, "train.train_steps", "must be >= 0", t.train_steps)
    _check(t.batch_size >= 1, "train.batch_size", "must be >= 1", t.batch_size)
    _check(t.learning_rate > 0, "train.learning_rate", "must be > 0", t.learning_rate)
    _check(t.adam_eps > 0, "train.adam_eps", "must be > 0", t.adam_eps)
    _check(t.max_grad_norm > 0, "train.max_grad_norm", "must be > 0", t.max_grad_norm)
    _check(0 <= t.gamma <= 1, "train.gamma", "must be in [0, 1]", t.gamma)
    _check(1 <= t.n_step <= 5, "train.n_step", "must be in 1..5", t.n_step)
    _check(t.target_update in ("hard", "polyak"), "train.target_update", "must be hard or polyak",
           t.target_update)
    _check(t.target_period >= 1, "train.target_period", "must be >= 1", t.target_period)
    _check(0 < t.polyak_tau <= 1, "train.polyak_tau", "must be in (0, 1]", t.polyak_tau)
    _check(0 <= t.epsilon_end <= t.epsilon_start <= 1, "train.epsilon_start",
           "and train.epsilon_end must satisfy 0 <= end <= start <= 1",
           (t.epsilon_start, t.epsilon_end))
    _check(t.epsilon_decay_epochs >= 1, "train.epsilon_decay_epochs", "must be >= 1",
           t.epsilon_decay_epochs)
    _check(t.validation_windows >= 1, "train.validation_windows", "must be >= 1",
           t.validation_windows)
    if e.name == "trading":
        _check(t.select_by in ("sharpe", "total_return", "loss"), "train.select_by",
               "must be sharpe, total_return or loss", t.select_by)
    else:  # a gymnax env: validation scores greedy episodes' returns (docs/agent.md)
        _check(t.select_by == "return", "train.select_by",
               f"must be return for a gymnax env (env.name {e.name})", t.select_by)
        _check(n.backend != "pallas", "network.backend",
               f"pallas runs the trading env's kernels only; use xla or auto for {e.name}",
               n.backend)
    _check(t.patience >= 0, "train.patience", "must be >= 0 (0: no early stopping)", t.patience)
    _check(t.checkpoint_every >= 1, "train.checkpoint_every", "must be >= 1", t.checkpoint_every)
    _check(t.log_every >= 1, "train.log_every", "must be >= 1", t.log_every)
    _check(t.shards >= 1, "train.shards", "must be >= 1", t.shards)
    _check(t.population >= 1, "train.population", "must be >= 1", t.population)
    _check(t.population == 1 or e.name == "trading", "train.population",
           f"must be 1 for a gymnax env (populations train the trading env; env.name {e.name})",
           t.population)
    _check(not t.overlap or t.population == 1, "train.overlap",
           f"must be false with train.population {t.population} (a population runs its own "
           "programs)", t.overlap)
    _check(t.seed + t.population - 1 <= SEED_RANGE[1], "train.population",
           f"members take seeds train.seed + i, which must stay <= {SEED_RANGE[1]}",
           t.population)
    _check(cfg.eval.random_policies >= 1, "eval.random_policies", "must be >= 1",
           cfg.eval.random_policies)
    for key, value in (("train.num_episodes", t.num_episodes), ("train.batch_size", t.batch_size),
                       ("replay.capacity", r.capacity)):
        _check(value % t.shards == 0, key, f"must be a multiple of train.shards ({t.shards})", value)
    if features != d.features:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(d, features=features))
    population_members(cfg)  # every member's hyperparameters parse and pass these checks
    return cfg


# ---------------------------------------------------------------------------------------------
# Populations: one dict of hyperparameters per member


def _key_type(key: str) -> type:
    section, name = key.split(".")
    return typing.get_type_hints(type(getattr(Config(), section)))[name]


def _population_key(entry: str, where: str) -> tuple[str, str]:
    if "=" not in entry:
        raise ConfigError(f"config key '{where}' entry {entry!r} must look like KEY=VALUES")
    key, values = (part.strip() for part in entry.split("=", 1))
    if key not in POPULATION_KEYS:
        raise ConfigError(f"config key '{where}' names {key!r}, which a population cannot vary "
                          f"(supported: {', '.join(POPULATION_KEYS)})")
    if not values:
        raise ConfigError(f"config key '{where}' gives no values for {key}")
    return key, values


def _number(text: str, tp: type, where: str, key: str) -> Any:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    return _coerce(value, tp, f"{where} ({key})")


def population_grid(cfg: Config) -> list[dict]:
    """The cells of ``population.grid`` in order (the last key varying fastest): ``[{}]``
    without a grid."""
    cells: list[dict] = [{}]
    seen = set()
    for entry in cfg.population.grid:
        key, values = _population_key(entry, "population.grid")
        if key in seen:
            raise ConfigError(f"config key 'population.grid' names {key} twice")
        seen.add(key)
        parsed = [_number(v.strip(), _key_type(key), "population.grid", key)
                  for v in values.split(",") if v.strip()]
        if not parsed:
            raise ConfigError(f"config key 'population.grid' gives no values for {key}")
        cells = [dict(cell, **{key: v}) for cell in cells for v in parsed]
    return cells


def population_draws(cfg: Config) -> dict[str, list]:
    """``{key: [value of member 0, 1, ...]}`` of ``population.random``: entry ``j`` draws its
    ``P`` values from ``numpy.random.default_rng([population.seed, j])``."""
    p, draws = cfg.train.population, {}
    for j, entry in enumerate(cfg.population.random):
        key, spec = _population_key(entry, "population.random")
        if key in draws:
            raise ConfigError(f"config key 'population.random' names {key} twice")
        scale = "linear"
        if ":" in spec:
            spec, scale = (part.strip() for part in spec.rsplit(":", 1))
        if scale not in ("linear", "log") or ".." not in spec:
            raise ConfigError(f"config key 'population.random' entry {entry!r} must look like "
                              f"KEY=LOW..HIGH or KEY=LOW..HIGH:log")
        tp = _key_type(key)
        low, high = (_number(v.strip(), tp, "population.random", key) for v in spec.split("..", 1))
        if not low <= high or (scale == "log" and low <= 0):
            raise ConfigError(f"config key 'population.random' needs LOW <= HIGH (and LOW > 0 "
                              f"for :log) for {key}, got {spec!r}")
        rng = np.random.default_rng([cfg.population.seed, j])
        if tp is int:
            draws[key] = [int(v) for v in rng.integers(low, high, size=p, endpoint=True)]
        elif scale == "log":
            draws[key] = [float(v) for v in np.exp(rng.uniform(np.log(low), np.log(high), p))]
        else:
            draws[key] = [float(v) for v in rng.uniform(low, high, p)]
    return draws


def population_members(cfg: Config) -> list[dict]:
    """One ``{key: value}`` dict a member (``train.population`` of them): member ``i`` takes
    grid cell ``i mod G`` and its own ``population.random`` draws; its seed is
    ``train.seed + i``. Every member's config (:func:`member_config`) is validated here, so a
    value out of range raises ConfigError naming the member."""
    p = cfg.train.population
    if p == 1 and not cfg.population.grid and not cfg.population.random:
        return [{}]  # a single agent: its config is this one
    cells, draws = population_grid(cfg), population_draws(cfg)
    both = sorted(set(cells[0]) & set(draws))
    if both:
        raise ConfigError(f"config keys 'population.grid' and 'population.random' both vary "
                          f"{', '.join(both)}")
    if p % len(cells):
        raise ConfigError(f"config key 'train.population' must be a multiple of the "
                          f"{len(cells)} cells of population.grid, got {p}")
    members = [dict(cells[i % len(cells)], **{k: v[i] for k, v in draws.items()})
               for i in range(p)]
    for i, hparams in enumerate(members):
        try:
            member_config(cfg, hparams, i)
        except ConfigError as e:
            raise ConfigError(f"population member {i} ({_hparams_text(hparams)}): {e}") from None
    return members


def _hparams_text(hparams: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in hparams.items()) or "no hyperparameters"


def member_config(cfg: Config, hparams: dict, index: int) -> Config:
    """The single-agent config of population member ``index``: ``hparams`` set, seed
    ``train.seed + index``, ``train.population`` 1 and no grid or draws; validated."""
    sections: dict = {"train": {"seed": cfg.train.seed + index, "population": 1},
                      "population": {"grid": [], "random": []}}
    for key, value in hparams.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return validate(_build(Config, _merge(to_dict(cfg), sections)))


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


# ---------------------------------------------------------------------------------------------
# Describing the keys: meanings, defaults, the commented YAML of `config show`, differences


@dataclass(frozen=True)
class KeyInfo:
    """One leaf key: dotted name, type as written in the annotation, default, meaning."""

    key: str
    type: str
    default: Any
    meaning: str


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list[{_type_name(args[0])}]"
        return f"list of {len(args)} {_type_name(args[0])}"
    return getattr(tp, "__name__", str(tp))


def keys(cls: type = Config, prefix: str = "") -> list[KeyInfo]:
    """Every leaf key of ``cls`` in declaration order, with its type, default and meaning."""
    out = []
    hints = typing.get_type_hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            out.extend(keys(hints[f.name], name + "."))
        else:
            out.append(KeyInfo(name, _type_name(hints[f.name]), to_dict(getattr(defaults, f.name)),
                               f.metadata["meaning"]))
    return out


def yaml_line(value: Any) -> str:
    """``value`` as one line of YAML (flow style) that ``yaml.safe_load`` reads back."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip()
    return text.removesuffix("...").strip()  # a bare scalar's document-end marker


def show_yaml(cfg: Config) -> str:
    """``cfg`` as YAML, every key commented with its meaning and its default.

    ``yaml.safe_load`` of the text gives :func:`to_dict` of ``cfg``."""
    lines: list[str] = []

    def walk(node: Any, default: Any, indent: str) -> None:
        for f in dataclasses.fields(node):
            value, meaning = getattr(node, f.name), f.metadata["meaning"]
            if dataclasses.is_dataclass(value):
                lines.append(f"{indent}{f.name}:  # {meaning}")
                walk(value, getattr(default, f.name), indent + "  ")
                continue
            text, base = (yaml_line(to_dict(v)) for v in (value, getattr(default, f.name)))
            lines.append(f"{indent}{f.name}: {text}  # {meaning} (default {base})")

    walk(cfg, Config(), "")
    return "\n".join(lines) + "\n"


def differences(a: Config, b: Config) -> list[tuple[str, Any, Any]]:
    """``(dotted key, value in a, value in b)`` of every leaf key where ``a`` and ``b`` differ."""
    flat_a, flat_b = _flatten(to_dict(a)), _flatten(to_dict(b))
    return [(k, flat_a[k], flat_b[k]) for k in flat_a if flat_a[k] != flat_b[k]]


def _flatten(mapping: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in mapping.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


__all__ = [
    "Config", "DataConfig", "SyntheticConfig", "EnvConfig", "NetworkConfig", "ReplayConfig",
    "CuriosityConfig", "TrainConfig", "EvalConfig", "PopulationConfig", "POPULATION_KEYS",
    "population_members", "member_config", "population_grid", "population_draws", "load_config",
    "from_dict", "replace",
    "validate", "to_dict", "dump_yaml", "parse_override", "read_yaml", "resolve_config_path",
    "setting", "KeyInfo", "keys", "show_yaml", "yaml_line", "differences",
]

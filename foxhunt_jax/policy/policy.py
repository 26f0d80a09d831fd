"""A trained agent as a policy: decisions on the latest bars and a pure, jittable stepping form.

Timing is the env's (docs/environment.md): the decision made at bar t fills at the open of the
next bar t+1 (``env.fill: next_open``) or at the close of t (``close``); bar t+1's
Open/High/Low are checked against the barriers and the position is marked at its close. Either
way the fill happens when the next bar is stepped in, so a live step needs nothing beyond that
bar. :func:`step` is exactly the env's :func:`~foxhunt_jax.env.trading.advance` from bar
t to the new bar t+1 followed by the greedy decision at t+1; the env functions run on a
two-row table per instrument (row 0 the current bar, row 1 the new one), so the portfolio and
barrier accounting is the env's own. The decision is the network forward training and
evaluation use (the resolved backend's ``q_forward`` for the greedy actions and
expected Q, its ``taken_logits`` for the chosen actions' return
distributions), batched over instruments.

Shapes: ``N`` instruments, ``F`` features, ``B`` branches, ``n_d`` actions of branch d,
``K`` atoms.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from foxhunt_jax.agent.learner import Learner, make_learner
from foxhunt_jax.agent.network import expected_q
from foxhunt_jax.backend import Backend, resolve, resolve_config
from foxhunt_jax.config import (Config, EnvConfig, from_dict, member_config, population_members,
                                read_yaml, to_dict)
from foxhunt_jax.data.features import MarketTables
from foxhunt_jax.env import trading
from foxhunt_jax.errors import ConfigError
from foxhunt_jax.policy import spec
from foxhunt_jax.training import checkpoint
from foxhunt_jax.training.phases import initial_state

AGENTS = ("selected", "last")  # which of a run's agents: the one selected on validation, the last
BAR_FIELDS = ("features", "open", "high", "low", "close", "sigma")
PARAMS_PATH = "agent/params"  # the network's path in a trainer state's checkpoint layout
# a step count never reached: no truncation, and no time barrier in the fill preview
_NEVER = 2 ** 30


def check_agent(agent: str) -> None:
    """Refuses, with one line naming the option, an ``agent`` not in :data:`AGENTS`."""
    if agent not in AGENTS:
        raise ConfigError(f"--agent must be one of {', '.join(AGENTS)}, got {agent!r}")


@struct.dataclass
class BarInputs:
    """One bar per instrument, as the env reads it: ``features`` [..., F] (normalized with the
    run's statistics), ``open``, ``high``, ``low``, ``close``, ``sigma`` [...] float32."""

    features: jax.Array
    open: jax.Array
    high: jax.Array
    low: jax.Array
    close: jax.Array
    sigma: jax.Array


@struct.dataclass
class PolicyState:
    """The live state between bars: ``portfolio`` (the env's :class:`EnvState` [N], its ``bar``
    0 = the current bar), the current ``bar`` ([N] inputs) and the ``action`` [N, B] decided at
    it, which fills (at its close or at the next bar's open) when the next bar is stepped in."""

    portfolio: trading.EnvState
    bar: BarInputs
    action: jax.Array


@struct.dataclass
class Decision:
    """The greedy decision at a bar, per instrument [N].

    ``action`` [N, B] int32 (exposure index, then take-profit and stop-loss indices where those
    branches exist); ``q``: per branch [N, n_d] expected Q of every action; ``mean`` [N, B] the
    chosen action's expected Q and ``p_loss`` [N, B] its probability of a negative return
    (atoms below 0) per branch; ``equity`` [N] marked at this bar's close before the trade;
    ``after``: the portfolio once the action has filled at this close (exposure, units,
    entry price, take-profit and stop-loss price levels, equity net of the trade's cost; under
    ``next_open`` fills a preview priced at this close, since the next open is not known yet);
    ``barrier`` [N] int32: the barrier that closed a position on this bar (0 none, 1
    take-profit, 2 stop-loss, 3 time, 4 ruin; always 0 for a first decision) and
    ``terminated`` [N]: equity fell below the ruin floor on this bar (the env's episode would
    end here).
    """

    action: jax.Array
    q: tuple
    mean: jax.Array
    p_loss: jax.Array
    equity: jax.Array
    after: trading.EnvState
    barrier: jax.Array
    terminated: jax.Array


@dataclasses.dataclass(frozen=True)
class Core:
    """The static pieces of a policy's decision: network, support, backend and the env
    settings (as :class:`EnvParams` whose tables each call replaces)."""

    learner: Learner
    env_cfg: EnvConfig
    backend: Backend

    @functools.cached_property
    def template(self) -> trading.EnvParams:
        one = np.zeros((2,), np.float32)
        tables = MarketTables(
            features=np.zeros((2, 1), np.float32), open=one, high=one, low=one, close=one + 1,
            sigma=one + 1, last_log_return=one, instrument=np.zeros(2, np.int32),
            timestamps=np.zeros(2, "datetime64[ns]"), segments={},
            starts={"train": np.zeros(1, np.int32)}, feature_names=(), norm_mean=one,
            norm_std=one, instrument_names=(), bar_seconds=1.0, bars_per_year=1.0,
            episode_length=1)
        cfg = dataclasses.replace(self.env_cfg, episode_length=_NEVER)
        # host arrays: constants of the traced functions (jax.export takes device arrays closed
        # over by a function of a symbolic batch for extra arguments)
        with jax.ensure_compile_time_eval():  # first use may be inside a trace
            return jax.tree.map(np.asarray, trading.make_params(tables, cfg, "train"))


def _pair_params(core: Core, first: BarInputs, second: BarInputs,
                 time_barrier: int | None = None) -> trading.EnvParams:
    """Env params of one instrument whose table is the two bars ``first`` (row 0) and
    ``second`` (row 1)."""
    two = lambda a, b: jnp.stack([a, b])  # noqa: E731
    p = core.template.replace(
        features=two(first.features, second.features), open=two(first.open, second.open),
        high=two(first.high, second.high), low=two(first.low, second.low),
        close=two(first.close, second.close), sigma=two(first.sigma, second.sigma))
    return p if time_barrier is None else p.replace(time_barrier=time_barrier)


def _still(bar: BarInputs) -> BarInputs:
    """A bar that opens, peaks, bottoms and closes at ``bar``'s close: it touches no barrier."""
    c = bar.close
    return bar.replace(open=c, high=c, low=c)


def _forward(core: Core, params, obs: jax.Array, per_row: bool):
    """Greedy actions [N, B], expected Q per branch [N, n_d] and the chosen actions' logits per
    branch [N, K]: the backend's ``q_forward`` and ``taken_logits`` of the run's network.
    ``per_row`` maps them over the rows (what an export with a symbolic batch needs)."""
    net, z = core.learner.network, core.learner.support

    def forward(o):
        q, actions = core.backend.q_forward(params, o, net, z, with_q=True)
        return q, actions, core.backend.taken_logits(params, o, actions, net)

    return jax.vmap(forward)(obs) if per_row else forward(obs)


def decide_at(core: Core, params, bar: BarInputs, portfolio: trading.EnvState,
              per_row: bool = False, barrier=None, terminated=None) -> Decision:
    """The greedy decision at ``bar`` [N] for the ``portfolio`` [N] held into its close."""
    env_p = jax.vmap(lambda b: _pair_params(core, b, _still(b)))(bar)
    obs = jax.vmap(trading.observation)(portfolio, env_p)  # [N, D]
    q, actions, taken = _forward(core, params, obs, per_row)
    z = core.learner.support
    mean = jnp.stack([expected_q(t, z) for t in taken], axis=1)  # [N, B]
    probs = jnp.stack([jax.nn.softmax(t, axis=-1) for t in taken], axis=1)  # [N, B, K]
    p_loss = jnp.sum(jnp.where(z < 0, probs, 0.0), axis=-1)
    # the fill at this close: the env's step onto a still bar, with no time barrier
    preview = jax.vmap(lambda b: _pair_params(core, b, _still(b), _NEVER))(bar)
    branches = tuple(actions[:, d] for d in range(actions.shape[-1]))
    after = jax.vmap(lambda s, a, p: trading.advance(s, a, p)[0])(portfolio, branches, preview)
    equity = portfolio.cash + portfolio.units * bar.close
    zeros = jnp.zeros(bar.close.shape, jnp.int32)
    return Decision(action=actions, q=tuple(q), mean=mean, p_loss=p_loss, equity=equity,
                    after=after.replace(bar=zeros, step=zeros),
                    barrier=zeros if barrier is None else barrier,
                    terminated=jnp.zeros(bar.close.shape, bool) if terminated is None
                    else terminated)


def start_at(core: Core, params, bar: BarInputs, portfolio: trading.EnvState,
             per_row: bool = False) -> tuple[Decision, PolicyState]:
    """The decision at ``bar`` and the state that :func:`step_from` continues."""
    decision = decide_at(core, params, bar, portfolio, per_row)
    return decision, PolicyState(portfolio=portfolio, bar=bar, action=decision.action)


def step_from(core: Core, params, state: PolicyState, new_bar: BarInputs,
              per_row: bool = False) -> tuple[Decision, PolicyState]:
    """The env's step from the current bar to ``new_bar`` with the pending action, then the
    decision at ``new_bar``. Pure; batched over instruments."""
    env_p = jax.vmap(lambda a, b: _pair_params(core, a, b))(state.bar, new_bar)
    branches = tuple(state.action[:, d] for d in range(state.action.shape[-1]))
    moved, _, terminated, _, info = jax.vmap(trading.advance)(state.portfolio, branches, env_p)
    zeros = jnp.zeros(new_bar.close.shape, jnp.int32)
    portfolio = moved.replace(bar=zeros, step=zeros)  # the new bar is row 0 from here on
    decision = decide_at(core, params, new_bar, portfolio, per_row, info["barrier"], terminated)
    return decision, PolicyState(portfolio=portfolio, bar=new_bar, action=decision.action)


@dataclasses.dataclass(frozen=True)
class Position:
    """A position held into the decision bar's close (default flat).

    ``exposure``: the nominal exposure (one of the run's ``env.exposures``); ``entry_price``
    (default: the decision bar's close); ``units`` held (default: ``exposure * equity /
    entry_price``); ``take_profit``/``stop_loss`` price levels (default: none, as a disabled
    barrier); ``bars_held`` (time in trade); ``equity`` marked at the decision bar's close
    (initial equity is 1).
    """

    exposure: float = 0.0
    entry_price: float | None = None
    units: float | None = None
    take_profit: float | None = None
    stop_loss: float | None = None
    bars_held: int = 0
    equity: float = 1.0


def check_position(position: Position, exposures) -> None:
    """ConfigError unless the position's exposure is one of the run's ``exposures``."""
    if float(position.exposure) not in [float(x) for x in exposures]:
        raise ConfigError(f"--position {position.exposure:g} is not one of the run's exposures "
                          f"({', '.join(f'{x:g}' for x in exposures)})")


def portfolio_of(position: Position, close: np.ndarray) -> trading.EnvState:
    """The env state [N] of ``position`` held at the closes [N] (the same for every
    instrument)."""
    n = close.shape[0]
    close = np.asarray(close, np.float32)
    full = lambda v: np.full((n,), v, np.float32)  # noqa: E731
    e = float(position.exposure)
    entry = full(position.entry_price) if position.entry_price is not None else close
    units = (full(position.units) if position.units is not None else
             np.where(e != 0, e * position.equity / entry, 0.0).astype(np.float32))
    cash = (position.equity - units * close).astype(np.float32)
    # a level not given is the env's disabled level for that side (never touched)
    off_tp, off_sl = (np.inf, 0.0) if e > 0 else (0.0, np.inf)
    tp = full(position.take_profit if position.take_profit is not None else off_tp)
    sl = full(position.stop_loss if position.stop_loss is not None else off_sl)
    flat = e == 0
    state = trading.fresh_state(np.zeros((n,), np.int32))
    return state.replace(
        equity=jnp.asarray(full(position.equity)), cash=jnp.asarray(cash),
        units=jnp.asarray(units), exposure=jnp.asarray(full(e)),
        entry_price=jnp.asarray(full(0.0) if flat else entry.astype(np.float32)),
        tp_price=jnp.asarray(full(0.0) if flat else tp),
        sl_price=jnp.asarray(full(0.0) if flat else sl),
        time_in_trade=jnp.asarray(np.full((n,), 0 if flat else position.bars_held, np.int32)))


def config_digest(cfg: Config) -> str:
    """sha256 of the run's config as canonical JSON."""
    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True).encode()).hexdigest()


def run_member_config(run_dir: Path, cfg: Config, member: int | None) -> Config:
    """The config an agent of the run acts under: the run's own, or for a population
    (``train.population`` P > 1) member ``member``'s (:func:`~foxhunt_jax.config.
    member_config`: its seed and hyperparameters). ConfigError when a population is given no
    member, a member outside ``0..P-1``, or a single-agent run a member."""
    size = cfg.train.population
    if size == 1:
        if member is not None:
            raise ConfigError(f"--member {member}: {run_dir} trained one agent, not a population")
        return cfg
    if member is None:
        raise ConfigError(f"{run_dir} holds a population of {size} agents: pass --member K "
                          f"(0..{size - 1}; {run_dir}/population.json and "
                          f"report/population_report.md name the member chosen on validation)")
    if not 0 <= member < size:
        raise ConfigError(f"--member must be in 0..{size - 1} (the run's population), got "
                          f"{member}")
    return member_config(cfg, population_members(cfg)[member], member)


def restore_params(run_dir: Path, cfg: Config, learner: Learner, agent: str = "last",
                   warn=None, member: int | None = None) -> tuple[Any, int, str, str]:
    """The network parameters of a run's agent, its epoch, which agent it is (``"selected"`` or
    ``"last"``) and a note that names it in words, restored
    into an abstract state of the run's config on this process's first device (no data is
    read).

    ``agent="last"``: the latest checkpoint's. ``"selected"``: the agent chosen on validation
    that the latest checkpoint's state had selected (``DIR/selected/``,
    :func:`~foxhunt_jax.training.checkpoint.restore_selected`; a damaged step is skipped with a
    ``warn`` line); a run from before selection gives its last agent, and the note says so.
    ``member``: of a population run (``cfg`` the run's own config), that member's agent: its
    slice of the checkpointed ``[P, ...]`` state, its selection from
    ``DIR/selected/member_<member>/``.
    """
    step = checkpoint.latest_step(run_dir / "checkpoints")
    if step is None:
        raise ConfigError(f"{run_dir}/checkpoints holds no checkpoint")
    f = len(cfg.data.features)
    sds = jax.ShapeDtypeStruct
    params = trading.EnvParams(
        features=sds((2, f), jnp.float32), open=sds((2,), jnp.float32),
        high=sds((2,), jnp.float32), low=sds((2,), jnp.float32), close=sds((2,), jnp.float32),
        sigma=sds((2,), jnp.float32), starts=sds((1,), jnp.int32), num_starts=sds((), jnp.int32),
        exposures=sds((len(cfg.env.exposures),), jnp.float32),
        take_profit=sds((len(cfg.env.take_profit),), jnp.float32),
        stop_loss=sds((len(cfg.env.stop_loss),), jnp.float32),
        cost_rate=sds((), jnp.float32), fixed_cost=sds((), jnp.float32),
        ruin_floor=sds((), jnp.float32), reward_scale=sds((), jnp.float32),
        slippage_rate=sds((), jnp.float32),
        episode_length=cfg.env.episode_length, time_barrier=cfg.env.time_barrier,
        has_take_profit=bool(cfg.env.take_profit), has_stop_loss=bool(cfg.env.stop_loss),
        fill_next_open=cfg.env.fill == "next_open")
    shape = jax.eval_shape(lambda p, k: initial_state(learner, cfg, p, k), params,
                           jax.ShapeDtypeStruct((2,), jnp.uint32))
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    members = () if member is None else (cfg.train.population,)  # the member axis in front
    target = jax.tree.map(lambda x: sds(members + x.shape, x.dtype, sharding=device),
                          shape.agent.params)
    # the network alone: acting does not depend on the optimizer's or the replay's layout
    params, meta = checkpoint.restore(run_dir / "checkpoints", step, target,
                                      prefix=PARAMS_PATH)
    if member is not None:
        params = jax.tree.map(lambda x: x[member], params)
    epoch = int(np.asarray(meta.get("epoch", step)))
    if agent == "last":
        return params, epoch, "last", f"last agent (epoch {epoch})"
    selected_dir = run_dir / checkpoint.SELECTED_DIR
    if member is not None:
        selected_dir = selected_dir / f"member_{member}"
    found = checkpoint.restore_selected(selected_dir, epoch, params,
                                        warn=warn or (lambda line: None))
    if found is None:
        return (params, epoch, "last", f"selected agent requested; the run records "
                f"none (it predates selection), so this is the last agent (epoch {epoch})")
    params, selected, chosen = found
    value = selected.get("value")
    shown = "n/a" if value is None else f"{value:+.4g}"
    return params, chosen, "selected", (f"selected agent (epoch {chosen} of {epoch}, validation "
                            f"{selected.get('select_by')} {shown})")


class Policy:
    """A trained run's greedy agent (:meth:`load`), deciding on bars and stepping bar by bar.

    ``decide(bars)`` gives the decision at each instrument's last bar (or ``at``);
    ``start(history)`` then ``step(state, new_bar)`` run it live. ``step`` and :meth:`decide_bar`
    are pure functions of their arguments (jittable; they are jitted here).
    """

    def __init__(self, core: Core, params, cfg: Config, stats: dict, run_dir: Path,
                 epoch: int, agent: str, agent_note: str):
        self.core, self.params, self.cfg, self.stats = core, params, cfg, stats
        self.run_dir, self.epoch, self.agent, self.agent_note = run_dir, epoch, agent, agent_note
        self._start = jax.jit(functools.partial(start_at, core))
        self._step = jax.jit(functools.partial(step_from, core))

    @classmethod
    def load(cls, run_dir: str | Path, agent: str = "selected", warn=None,
             member: int | None = None) -> "Policy":
        """The agent of a run directory. ``agent="selected"``: the agent chosen on validation
        (``train.select_by``; a run from before selection gives its last agent and
        ``agent_note`` says so); ``"last"``: the latest checkpoint (:func:`restore_params`).
        ``member``: which member of a population run (required there; its own config,
        :func:`run_member_config`)."""
        run = Path(run_dir)
        check_agent(agent)
        if not (run / "config.yaml").is_file():
            raise ConfigError(f"{run} is not a run directory (no config.yaml)")
        run_cfg = resolve_config(from_dict(read_yaml(run / "config.yaml")))
        cfg = run_member_config(run, run_cfg, member)
        learner = make_learner(cfg, cfg.env.branch_sizes)
        stats = spec.run_statistics(run, cfg, warn)
        params, epoch, which, note = restore_params(run, run_cfg, learner, agent, warn, member)
        if member is not None:
            note = f"member {member}'s {note}"
        core = Core(learner=learner, env_cfg=cfg.env, backend=resolve(cfg.network))
        return cls(core, params, cfg, stats, run, epoch, which, note)

    # --- bars -> inputs ------------------------------------------------------------------

    def bar_tables(self, bars, at=None) -> list[dict]:
        """Per instrument of ``bars`` (DataFrame, MarketData or Instruments), every decidable
        bar up to ``at`` (:func:`spec.tables_at`), checked against the run."""
        return spec.tables_at(spec.as_instruments(bars), at, self.stats, str(self.run_dir))

    @staticmethod
    def inputs(tables: list[dict], row: int = -1) -> BarInputs:
        """Row ``row`` of each instrument's bar table, stacked into :class:`BarInputs` [N]."""
        take = lambda k: jnp.asarray(np.stack([t[k][row] for t in tables]))  # noqa: E731
        return BarInputs(features=take("features"), open=take("open"), high=take("high"),
                         low=take("low"), close=take("close"), sigma=take("sigma"))

    # --- decisions ------------------------------------------------------------------------

    def start(self, history, position: Position = Position(), at=None
              ) -> tuple[Decision, PolicyState]:
        """The decision at each instrument's last bar of ``history`` (or at ``at``) and the
        live state that :meth:`step` continues."""
        bar = self.inputs(self.bar_tables(history, at))
        return self.start_bar(bar, position)

    def start_bar(self, bar: BarInputs, position: Position = Position()
                  ) -> tuple[Decision, PolicyState]:
        """The decision at ``bar`` [N] for ``position`` and the state :meth:`step` continues."""
        check_position(position, self.cfg.env.exposures)
        return self._start(self.params, bar, portfolio_of(position, np.asarray(bar.close)))

    def step(self, state: PolicyState, new_bar: BarInputs) -> tuple[Decision, PolicyState]:
        """One new bar per instrument: the pending action fills, the new bar's barriers and
        mark apply (the env's step), then the decision at the new bar. Pure and jitted."""
        return self._step(self.params, state, new_bar)

    def decide(self, bars, at=None, position: Position = Position()) -> list[dict]:
        """Per instrument, the decision at its last bar (or at ``at``) as a plain dict
        (:meth:`describe`)."""
        tables = self.bar_tables(bars, at)
        decision, _ = self.start_bar(self.inputs(tables), position)
        return self.describe(decision, tables, position)

    # --- output ---------------------------------------------------------------------------

    def describe(self, decision: Decision, tables: list[dict], position: Position,
                 row: int = -1) -> list[dict]:
        """The decision per instrument as JSON-ready dicts (:func:`describe`)."""
        return describe(decision_dict(decision), tables, self.cfg.env, position,
                        self.stats.get("instruments", []), self.agent_note, row)


def _fields(x) -> dict:
    return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}


def decision_dict(decision: Decision) -> dict:
    """A :class:`Decision` as nested dicts and lists of arrays (the export's layout)."""
    d = _fields(decision)
    d["q"] = list(decision.q)
    d["after"] = _fields(decision.after)
    return d


def state_dict(state: PolicyState) -> dict:
    """A :class:`PolicyState` as nested dicts of arrays (the export's layout)."""
    return {"portfolio": _fields(state.portfolio), "bar": _fields(state.bar),
            "action": state.action}


def describe(decision: dict, tables: list[dict], env: EnvConfig, position: Position,
             trained_on, agent_note: str, row: int = -1) -> list[dict]:
    """Per instrument, a decision (:func:`decision_dict` layout) as a JSON-ready dict: the
    bar's and the data's last timestamps, the exposure and barrier choices as actions and as
    price levels, every action's expected Q per branch, the chosen actions' return
    distribution summary, the portfolio decided from and the one after the fill."""
    d = jax.tree.map(np.asarray, jax.device_get(decision))
    seen = set(trained_on)
    branch = {"exposure": (env.exposures, 0)}
    for name, values in (("take_profit", env.take_profit), ("stop_loss", env.stop_loss)):
        if values:
            branch[name] = (values, len(branch))
    out = []
    for i, t in enumerate(tables):
        act = [int(a) for a in d["action"][i]]
        after = {k: v[i] for k, v in d["after"].items()}
        rec = {"instrument": t["instrument"], "timestamp": _time(t["timestamps"][row]),
               "data_last_timestamp": _time(t["data_last_timestamp"]),
               "close": float(t["close"][row]), "sigma": float(t["sigma"][row]),
               "exposure": float(env.exposures[act[0]]), "exposure_action": act[0]}
        levels = {"take_profit": float(after["tp_price"]), "stop_loss": float(after["sl_price"])}
        for name in ("take_profit", "stop_loss"):
            rec[name] = None
            if name in branch:
                values, c = branch[name]
                level = levels[name]
                rec[name] = {"action": act[c], "sigma_multiple": float(values[act[c]]),
                             "price": level if 0 < level < np.inf else None}
        rec["q"] = {name: [float(x) for x in d["q"][c][i]] for name, (_, c) in branch.items()}
        rec["return_distribution"] = {
            name: {"mean": float(d["mean"][i, c]), "p_loss": float(d["p_loss"][i, c])}
            for name, (_, c) in branch.items()}
        rec["portfolio"] = dataclasses.asdict(position)
        rec["after_fill"] = {"exposure": float(after["exposure"]), "units": float(after["units"]),
                             "entry_price": float(after["entry_price"]),
                             "equity": float(after["equity"]),
                             "trades": bool(after["exposure"] != position.exposure)}
        rec["seen_in_training"] = t["instrument"] in seen
        rec["agent"] = agent_note
        out.append(rec)
    return out


def _time(ts) -> str:
    return str(np.datetime64(ts, "s")).replace("T", " ")


__all__ = ["Policy", "Position", "BarInputs", "PolicyState", "Decision", "Core", "AGENTS",
           "check_agent", "decide_at", "start_at", "step_from", "portfolio_of", "check_position",
           "restore_params", "config_digest", "decision_dict", "state_dict", "describe"]

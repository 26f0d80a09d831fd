"""The learner step: C51 double-Q update with prioritized replay, target update and RND.

One jitted function does a whole step:

    sample batch (prioritized) -> decode observations -> online(s), target(s'), online(s')
    -> per-sample C51 double-Q loss -> importance-weighted mean -> grads
    -> clip by the global norm and Adam (agent/optimizer.py), one pass a parameter
       (writing a bfloat16 network's kernels in bfloat16 too, for the next step's forwards)
    -> target update (hard every M steps or Polyak)
    -> new priorities = per-sample loss -> RND predictor update on s'

``train_steps`` runs K of them under ``lax.scan``, software-pipelined: each iteration draws the
next batch beside its own backward pass. The learner is generic over what the replay
buffer stores: ``decode(items) -> (obs [M, D], next_obs [M, D])`` rebuilds observations, so the
trading agent can store compact transitions and CartPole can store whole observations.

A replay item must hold ``action [B] int32``, ``reward`` (the n-step return) and ``discount``
(gamma^k, 0 when the episode terminated inside the n-step window).
"""

from __future__ import annotations


from dataclasses import dataclass
from typing import Any, Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from foxhunt_jax.agent import curiosity, replay
from foxhunt_jax.agent.loss import c51_loss_and_edge_mass
from foxhunt_jax.agent.network import (QNetwork, compute_params, explore_actions,
                                       greedy_actions, init_params, make_network, q_forward,
                                       support as make_support, taken_logits)
from foxhunt_jax.agent.optimizer import clipped_adam
from foxhunt_jax.config import Config, CuriosityConfig, NetworkConfig, ReplayConfig, TrainConfig
from pallas_kernels.tuning import ReplaySearch

Decode = Callable[[Any], tuple[jax.Array, jax.Array]]


@struct.dataclass
class AgentState:
    """Everything the learner updates. ``rnd`` is None when curiosity is off."""

    params: Any
    target_params: Any
    opt_state: Any
    rnd: Any
    step: jax.Array  # learner steps taken, int32


@dataclass(frozen=True)
class Learner:
    """Static pieces of the learner: network, optimizer and hyper-parameters (hashable for jit).

    ``replay_search``: how the replay's slot search runs (:func:`replay.sample`), a shape of
    the device (``Backend.tuning.replay``); the default is right on every device, only slower
    on a GPU.

    ``target_copy``: how a hard target update is written, with the same result. ``"select"``
    reads and writes every parameter at every step; ``"conditional"`` only at a copy step, but
    on a GPU a conditional in the learner's loop lengthens each step (docs/performance.md), so
    only a population, whose parameters are P times larger and whose members share one step
    counter (:func:`~foxhunt_jax.training.population.population_training`), uses it.
    """

    network: QNetwork
    optimizer: optax.GradientTransformation
    net_cfg: NetworkConfig
    train_cfg: TrainConfig
    replay_cfg: ReplayConfig
    curiosity_cfg: CuriosityConfig
    replay_search: ReplaySearch = ReplaySearch()
    target_copy: str = "select"

    @property
    def support(self) -> jax.Array:
        return make_support(self.net_cfg.v_min, self.net_cfg.v_max, self.net_cfg.atoms)

    def __hash__(self):
        return id(self)

    def __eq__(self, other):
        return self is other


def make_learner(cfg: Config, branch_sizes: tuple[int, ...], *,
                 replay_search: ReplaySearch = ReplaySearch()) -> Learner:
    """The learner of ``cfg`` for an env with ``branch_sizes``; ``replay_search`` as
    :class:`Learner` (the trainer passes its backend's ``tuning.replay``).

    Its support is ``[network.v_min, network.v_max]``: whoever runs the env resolves
    ``network.support: auto`` first (:mod:`foxhunt_jax.agent.value_range`; the trainer does);
    an unresolved config's placeholder range is used as it is."""
    net = make_network(cfg.network, branch_sizes)
    t = cfg.train
    return Learner(net, make_optimizer(t), cfg.network, t, cfg.replay,
                   curiosity.resolve_precision(cfg.curiosity, cfg.network.dtype),
                   replay_search)


def make_optimizer(train_cfg: TrainConfig, learning_rate=None) -> optax.GradientTransformation:
    """Global-norm clipping then Adam at ``learning_rate`` (default ``train.learning_rate``; a
    traced ``[]`` array in a population program), :func:`~foxhunt_jax.agent.optimizer.clipped_adam`.
    Its state does not depend on the rate."""
    rate = train_cfg.learning_rate if learning_rate is None else learning_rate
    return clipped_adam(rate, train_cfg.max_grad_norm, eps=train_cfg.adam_eps)


def init_agent(key: jax.Array, learner: Learner, obs_dim: int) -> AgentState:
    k_net, k_rnd = jax.random.split(key)
    params = init_params(learner.network, k_net, jnp.zeros((1, obs_dim), jnp.float32))
    rnd = None
    if learner.curiosity_cfg.coef > 0:
        rnd = curiosity.init(k_rnd, obs_dim, learner.curiosity_cfg)
    # a distinct copy: the target must not alias the online buffers (donation would see one twice)
    return AgentState(params=params, target_params=jax.tree.map(jnp.copy, params),
                      opt_state=learner.optimizer.init(params), rnd=rnd,
                      step=jnp.zeros((), jnp.int32))


def per_sample_loss(learner: Learner, params, target_params, obs, next_obs, action, returns,
                    discount, backend=None) -> jax.Array:
    """C51 double-Q loss per sample [M] (:func:`~foxhunt_jax.agent.loss.c51_loss`): three
    forwards, online at s' for its greedy actions, online at s and target at s' for the logits
    of the taken and of those greedy actions.

    ``backend`` None runs the definitions (Flax and jnp, differentiable): the update
    (:func:`loss_and_edge_mass`). A :class:`foxhunt_jax.backend.Backend` runs its ``q_forward``,
    ``taken_logits`` and ``bootstrap_loss`` instead (no gradient through a kernel). The initial
    priorities (:func:`foxhunt_jax.training.collect.collect`) and the validation loss build this
    same loss from parts their rollouts already computed, on their backend; tests compare both
    to this function.
    """
    if backend is None:
        return loss_and_edge_mass(learner, params, target_params, obs, next_obs, action,
                                  returns, discount)[0]
    net, z = learner.network, learner.support
    _, best = backend.q_forward(params, next_obs, net, z)
    return backend.bootstrap_loss(target_params, next_obs, best,
                                  backend.taken_logits(params, obs, action, net), returns,
                                  discount, net, z)


def loss_and_edge_mass(learner: Learner, params, target_params, obs, next_obs, action, returns,
                       discount) -> tuple[jax.Array, jax.Array]:
    """:func:`per_sample_loss` by the definitions (Flax and jnp, differentiable in ``params``)
    and the target probability its projection clips onto the support's edge atoms
    (:func:`~foxhunt_jax.agent.loss.c51_loss_and_edge_mass`), both ``[M]``.

    The update always runs this, whatever the backend, so the learner's ``support_edge_mass``
    does not depend on ``network.backend``.
    """
    net, z = learner.network, learner.support
    _, best = q_forward(params, next_obs, net, z)  # an argmax has no gradient
    return c51_loss_and_edge_mass(taken_logits(params, obs, action, net),
                                  taken_logits(target_params, next_obs, best, net), returns,
                                  discount, z)


def _update_target(learner: Learner, params, target_params, step):
    """The target network after learner step ``step``: a Polyak average, or ``params`` itself
    every ``target_period`` steps, by :attr:`Learner.target_copy`. ``params`` and
    ``target_params`` may be any matching trees (the networks and their compute copies
    together)."""
    t = learner.train_cfg
    if t.target_update == "polyak":
        return optax.incremental_update(params, target_params, t.polyak_tau)
    copy = (step % t.target_period) == 0
    if learner.target_copy == "conditional":
        return jax.lax.cond(copy, lambda: params, lambda: target_params)
    return jax.tree.map(lambda p, q: jnp.where(copy, p, q), params, target_params)


@struct.dataclass
class Batch:
    """A prioritized draw from the replay buffer (:func:`sample_batch`).

    Attributes:
      obs, next_obs: ``[M, D]`` decoded observations (s and the bootstrap observation).
      items: the replay items ``[M, ...]`` (``action``, ``reward``, ``discount`` are read).
      indices: their slots, ``[M]`` int32, or ``[S, M/S]`` for a sharded buffer.
      weights: ``[M]`` float32 importance weights.
    """

    obs: jax.Array
    next_obs: jax.Array
    items: Any
    indices: jax.Array
    weights: jax.Array


METRICS = ("loss", "grad_norm", "rnd_loss", "support_edge_mass")  # a step's, float32 []


def forward_copies(learner: Learner, agent: AgentState):
    """``(online, target)``: the agent's networks as the forwards read them
    (:func:`~foxhunt_jax.agent.network.compute_params`), or None for a float32 network, whose
    forwards read the parameters themselves."""
    if learner.network.dtype == "float32":
        return None
    return (compute_params(learner.network, agent.params),
            compute_params(learner.network, agent.target_params))


def _update(learner: Learner, agent: AgentState, batch: Batch, copies=None):
    """The update of one batch with its importance weights.

    ``copies``: :func:`forward_copies` of ``agent``, which the forwards then read and the
    update writes anew beside the parameters (None: the forwards read the parameters; the
    results are the same).

    Returns the new agent, the per-sample losses ``[M]`` (the new priorities), the metrics
    (``loss``, ``grad_norm``, ``rnd_loss``, ``support_edge_mass``: the batch's mean share of
    target probability clipped onto the support's edge atoms) and the new agent's copies (None
    when ``copies`` is None).
    The loss is the weighted mean over the whole batch: when the batch is split over devices,
    XLA all-reduces the devices' partial gradients.
    """
    obs, next_obs, items, weights = batch.obs, batch.next_obs, batch.items, batch.weights
    online, target = (agent.params, agent.target_params) if copies is None else copies

    def loss_fn(params):
        losses, edge_mass = loss_and_edge_mass(learner, params, target, obs, next_obs,
                                               items["action"], items["reward"],
                                               items["discount"])
        return jnp.mean(weights * losses), (losses, edge_mass)

    (loss, (losses, edge_mass)), grads = jax.value_and_grad(loss_fn, has_aux=True)(online)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, agent.params)
    updates, opt_state = learner.optimizer.update(grads, agent.opt_state, agent.params)
    params = optax.apply_updates(agent.params, updates)
    step = agent.step + 1
    if copies is None:
        target_params = _update_target(learner, params, agent.target_params, step)
    else:
        online = compute_params(learner.network, params)
        if learner.train_cfg.target_update == "polyak":
            target_params = _update_target(learner, params, agent.target_params, step)
            target = compute_params(learner.network, target_params)
        else:  # a hard copy moves the online copy with the parameters, in one conditional
            target_params, target = _update_target(learner, (params, online),
                                                   (agent.target_params, target), step)
        copies = (online, target)
    rnd, rnd_loss = agent.rnd, jnp.zeros((), jnp.float32)
    if agent.rnd is not None:
        rnd, rnd_loss = curiosity.update(agent.rnd, next_obs)
    # support_edge_mass: the batch's mean share of target probability clipped onto the edge atoms
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "rnd_loss": rnd_loss,
               "support_edge_mass": jnp.mean(edge_mass)}
    agent = AgentState(params=params, target_params=target_params, opt_state=opt_state, rnd=rnd,
                       step=step)
    return agent, jax.lax.stop_gradient(losses), metrics, copies


def sample_batch(learner: Learner, decode: Decode, buffer: replay.ReplayState, key: jax.Array,
                 beta: jax.Array) -> Batch:
    """A prioritized :class:`Batch` of ``M = train.batch_size`` items, decoded.

    A sharded buffer (:func:`replay.init_shards`, priorities ``[S, C/S]``) gives ``M/S`` items
    per shard (:func:`replay.sample_shards`), flattened into one batch; its ``indices`` stay
    ``[S, M/S]`` (slots of each shard).
    """
    m = learner.train_cfg.batch_size
    search = learner.replay_search
    if replay.num_shards(buffer) is None:
        items, indices, weights = replay.sample(buffer, key, m, beta, search)
    else:
        items, indices, weights = replay.sample_shards(buffer, key, m, beta,
                                                       search)  # [S, M/S, ...]
        flat = lambda x: x.reshape((-1,) + x.shape[2:])  # noqa: E731
        items, weights = jax.tree.map(flat, items), flat(weights)
    obs, next_obs = decode(items)
    return Batch(obs=obs, next_obs=next_obs, items=items, indices=indices, weights=weights)


def learn_batch(learner: Learner, agent: AgentState, buffer: replay.ReplayState,
                batch: Batch) -> tuple[AgentState, replay.ReplayState, dict]:
    """The update from a :class:`Batch`; returns new agent, the buffer with the batch's new
    priorities, and the metrics."""
    return _learn(learner, agent, buffer, batch)[:3]


def _learn(learner: Learner, agent: AgentState, buffer: replay.ReplayState, batch: Batch,
           copies=None):
    """:func:`learn_batch` with the forwards' ``copies`` (:func:`_update`), also returned."""
    r = learner.replay_cfg
    agent, losses, metrics, copies = _update(learner, agent, batch, copies)
    if replay.num_shards(buffer) is None:
        buffer = replay.update_priorities(buffer, batch.indices, losses, r.alpha, r.priority_eps)
    else:
        buffer = replay.update_priorities_shards(buffer, batch.indices,
                                                 losses.reshape(batch.indices.shape), r.alpha,
                                                 r.priority_eps)
    return agent, buffer, metrics, copies


def learner_step(learner: Learner, decode: Decode, agent: AgentState, buffer: replay.ReplayState,
                 key: jax.Array, beta: jax.Array) -> tuple[AgentState, replay.ReplayState, dict]:
    """One update from a prioritized batch; returns new agent, buffer with new priorities, metrics.

    A plain or a sharded buffer (:func:`sample_batch`); the update sees the ``M`` items as one
    batch.
    """
    return learn_batch(learner, agent, buffer, sample_batch(learner, decode, buffer, key, beta))


def train_steps(learner: Learner, decode: Decode, agent: AgentState, buffer: replay.ReplayState,
                key: jax.Array, beta: jax.Array, num_steps: int, unroll: int = 1):
    """K learner steps under ``lax.scan`` (``unroll`` steps an iteration); metrics are averaged
    over the K steps.

    Step ``t`` is :func:`learner_step` with key ``split(key, K)[t]``, and the result is the same,
    but the loop is software-pipelined: iteration ``t`` updates from batch ``t`` and then draws
    and decodes batch ``t + 1``. The draw needs only the priorities that batch ``t``'s forward
    sets, not the backward or the optimizer, so in one iteration's program XLA runs the next
    draw beside the backward instead of after it: the draw is a chain of small kernels that no
    longer lies between one update and the next. The last
    iteration's draw is not used. The forwards read the networks' copies in the GEMMs' dtype
    (:func:`forward_copies`), which each update writes beside the float32 parameters.

    ``buffer`` may be plain or sharded (see :func:`sample_batch`).
    """
    keys = jax.random.split(key, num_steps)

    def body(carry, k_next):
        agent, buffer, batch, sums, copies = carry
        agent, buffer, m, copies = _learn(learner, agent, buffer, batch, copies)
        sums = jax.tree.map(jnp.add, sums, m)
        return (agent, buffer, sample_batch(learner, decode, buffer, k_next, beta), sums,
                copies), None

    first = sample_batch(learner, decode, buffer, keys[0], beta)
    following = jnp.concatenate([keys[1:], keys[:1]])  # the last draw is discarded
    # The metrics are summed in the carry, not stacked per step: a stacked output is a
    # dynamic-update-slice in the loop body, and one that fuses with no computation keeps XLA
    # from capturing the loop in a CUDA graph (it then runs the steps one by one from the host).
    zeros = {name: jnp.zeros((), jnp.float32) for name in METRICS}
    carry = (agent, buffer, first, zeros, forward_copies(learner, agent))
    (agent, buffer, _, sums, _), _ = jax.lax.scan(body, carry, following, unroll=unroll)
    return agent, buffer, jax.tree.map(lambda total: total / num_steps, sums)


def linear_schedule(start, end, span, epoch):
    """``start`` moving linearly to ``end`` over ``span`` epochs, then ``end`` (epoch 0-based).

    Python numbers give a Python float (the host's view); any JAX array (a traced epoch inside
    a phase program) gives a float32 array.
    """
    if all(isinstance(v, (int, float, np.number)) for v in (start, end, span, epoch)):
        frac = min(max(epoch / span, 0.0), 1.0)
    else:
        frac = jnp.clip(jnp.asarray(epoch, jnp.float32) / span, 0.0, 1.0)
    return start + frac * (end - start)


def epsilon_at(train_cfg: TrainConfig, epoch: int) -> float:
    """Exploration rate of an epoch: linear decay from epsilon_start to epsilon_end over
    epsilon_decay_epochs."""
    return linear_schedule(train_cfg.epsilon_start, train_cfg.epsilon_end,
                           train_cfg.epsilon_decay_epochs, epoch)


def beta_at(replay_cfg: ReplayConfig, train_cfg: TrainConfig, epoch: int) -> float:
    """Importance-sampling exponent annealed linearly from beta_start to beta_end over the run."""
    return linear_schedule(replay_cfg.beta_start, replay_cfg.beta_end,
                           max(train_cfg.epochs - 1, 1), epoch)


def schedule_values(replay_cfg: ReplayConfig, train_cfg: TrainConfig) -> np.ndarray:
    """``[6]`` float32: epsilon's start, end and span, then beta's, as :func:`epsilon_at` and
    :func:`beta_at` use them.

    The phase programs take this array as an argument and compute both rates from the epoch
    counter on the device (:func:`epsilon_from`, :func:`beta_from`): no host value is copied
    into a program each epoch, and one compiled program still serves every run length.
    """
    return np.asarray([train_cfg.epsilon_start, train_cfg.epsilon_end,
                       train_cfg.epsilon_decay_epochs, replay_cfg.beta_start,
                       replay_cfg.beta_end, max(train_cfg.epochs - 1, 1)], np.float32)


def epsilon_from(schedule: jax.Array, epoch: jax.Array) -> jax.Array:
    """:func:`epsilon_at` from :func:`schedule_values` (on the device)."""
    return linear_schedule(schedule[0], schedule[1], schedule[2], epoch)


def beta_from(schedule: jax.Array, epoch: jax.Array) -> jax.Array:
    """:func:`beta_at` from :func:`schedule_values` (on the device)."""
    return linear_schedule(schedule[3], schedule[4], schedule[5], epoch)


def epsilon_greedy(key: jax.Array, logits: tuple, support: jax.Array, epsilon) -> jax.Array:
    """Per-branch epsilon-greedy actions [N, B] from Q logits (a tuple of [N, n_d, K]).

    Each branch of each episode explores independently with probability epsilon.
    """
    greedy = greedy_actions(logits, support)
    out = explore_actions(key, greedy, [lg.shape[-2] for lg in logits], epsilon)
    chex.assert_shape(out, (greedy.shape[0], len(logits)))
    return out

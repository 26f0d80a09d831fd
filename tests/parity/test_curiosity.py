"""RND curiosity: forward pass, bonus scaling, running statistics and predictor training,
each against an independent float64 NumPy computation."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax.agent import curiosity
from foxhunt_jax.agent.network import (F32_FAST_PRECISION, F32_PRECISION,
                                       F32_PRECISION_MIN_ROWS)
from foxhunt_jax.config import CuriosityConfig
from foxhunt_jax.errors import ConfigError

CFG = CuriosityConfig(coef=0.3, hidden=32, embed=8, learning_rate=1e-3)
D = 9


def np_embed(params, x):
    """float64 forward pass of the RND MLP."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
    h = np.maximum(x @ p["hidden_0"]["kernel"] + p["hidden_0"]["bias"], 0)
    h = np.maximum(h @ p["hidden_1"]["kernel"] + p["hidden_1"]["bias"], 0)
    return h @ p["out"]["kernel"] + p["out"]["bias"]


def np_raw(state, x):
    x = np.asarray(x, np.float64)
    return np.sum((np_embed(state.predictor_params, x) - np_embed(state.target_params, x)) ** 2, -1)


def test_init_shapes_and_independent_networks():
    state = curiosity.init(jax.random.key(0), D, CFG)
    chex.assert_shape(state.target_params["params"]["hidden_0"]["kernel"], (D, CFG.hidden))
    pred = state.predictor_params["params"]
    chex.assert_shape(pred["hidden_1"]["kernel"], (CFG.hidden, CFG.hidden))
    chex.assert_shape(pred["out"]["kernel"], (CFG.hidden, CFG.embed))
    chex.assert_type([state.count, state.mean, state.var], jnp.float32)
    assert float(state.count) == 0.0
    t, p = (state.target_params["params"]["hidden_0"]["kernel"],
            state.predictor_params["params"]["hidden_0"]["kernel"])
    assert not np.allclose(np.asarray(t), np.asarray(p))  # different init keys


def test_prediction_error_and_bonus_match_numpy():
    rng = np.random.default_rng(1)
    state = curiosity.init(jax.random.key(int(rng.integers(1 << 30))), D, CFG)
    obs = rng.standard_normal((37, D)).astype(np.float32)
    raw = curiosity.prediction_error(state, jnp.asarray(obs))
    chex.assert_shape(raw, (37,))
    chex.assert_type(raw, jnp.float32)
    ref = np_raw(state, obs)
    np.testing.assert_allclose(np.asarray(raw, np.float64), ref, rtol=1e-4)
    # No statistics yet: std counts as 1.
    np.testing.assert_allclose(np.asarray(curiosity.intrinsic_reward(state, jnp.asarray(obs))),
                               CFG.coef * ref, rtol=1e-4)
    seen = rng.lognormal(0.0, 1.0, 200)
    state = curiosity.update_stats(state, jnp.asarray(seen, jnp.float32))
    bonus = curiosity.intrinsic_reward(state, jnp.asarray(obs))
    np.testing.assert_allclose(np.asarray(bonus, np.float64),
                               CFG.coef * ref / np.sqrt(np.var(seen) + 1e-8), rtol=1e-4)


@pytest.mark.parametrize("rows", [F32_PRECISION_MIN_ROWS - 1, F32_PRECISION_MIN_ROWS])
def test_prediction_error_matches_numpy_on_both_f32_algorithms(rows):
    """The RND GEMMs switch algorithm at F32_PRECISION_MIN_ROWS rows (on a GPU): the raw
    novelty stays within 1e-5 of float64 on both sides, for a fresh predictor."""
    rng = np.random.default_rng(rows)
    state = curiosity.init(jax.random.key(rows), D, CFG)
    obs = rng.standard_normal((rows, D)).astype(np.float32)
    raw = curiosity.prediction_error(state, jnp.asarray(obs))
    np.testing.assert_allclose(np.asarray(raw, np.float64), np_raw(state, obs), rtol=1e-5)


def _dot_precisions(cfg, rows):
    """The precision / algorithm of every dot of the curiosity pass over ``rows`` rows."""
    state = curiosity.init(jax.random.key(0), D, cfg)
    jaxpr = jax.make_jaxpr(curiosity.prediction_error)(state, jnp.zeros((rows, D), jnp.float32))
    return [e.params["precision"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]


@pytest.mark.parametrize("precision,want", [("float32", F32_PRECISION),
                                            ("auto", F32_PRECISION),
                                            ("bf16x3", F32_FAST_PRECISION)])
def test_precision_picks_the_pass_algorithm_and_keeps_small_batches_exact(precision, want):
    """From F32_PRECISION_MIN_ROWS rows the pass runs the configured algorithm (an undecided
    "auto" means float32); the predictor's update at a learner batch keeps true f32."""
    cfg = dataclasses.replace(CFG, precision=precision)
    big = _dot_precisions(cfg, F32_PRECISION_MIN_ROWS)
    assert len(big) == 6 and all(p in (want, (want, want)) for p in big), big
    small = _dot_precisions(cfg, 64)
    highest = jax.lax.Precision.HIGHEST
    assert len(small) == 6 and all(p in (highest, (highest, highest)) for p in small), small


@pytest.mark.parametrize("dtype,want", [("bfloat16", "bf16x3"), ("float32", "float32")])
def test_auto_precision_follows_the_q_network_dtype(dtype, want):
    from foxhunt_jax.agent.learner import make_learner
    from foxhunt_jax.config import load_config

    learner = make_learner(load_config("smoke", [f"network.dtype={dtype}"]), (5, 3, 3))
    assert learner.curiosity_cfg.precision == want
    fixed = make_learner(load_config("smoke", [f"network.dtype={dtype}",
                                               "curiosity.precision=float32"]), (5, 3, 3))
    assert fixed.curiosity_cfg.precision == "float32"
    with pytest.raises(ConfigError, match="curiosity.precision"):
        load_config("smoke", ["curiosity.precision=tf32"])


def test_coef_zero_reward_is_exactly_extrinsic():
    rng = np.random.default_rng(2)
    state = curiosity.init(jax.random.key(3), D, CuriosityConfig(coef=0.0, hidden=16, embed=4))
    obs = jnp.asarray(rng.standard_normal((50, D)), jnp.float32)
    r = rng.standard_normal(50).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 50)
    r[:3] = [0.0, -0.0, np.float32(1e-45)]
    r = jnp.asarray(r)
    total = jax.jit(lambda s, o, r: r + curiosity.intrinsic_reward(s, o))(state, obs, r)
    assert jnp.array_equal(total, r)
    assert jnp.array_equal(r + curiosity.scale_bonus(state, jnp.ones(50)), r)
    new, loss = curiosity.update(state, obs)
    assert float(loss) == 0.0
    chex.assert_trees_all_equal(new.predictor_params, state.predictor_params)


def test_predictor_learns_and_target_stays_fixed():
    rng = np.random.default_rng(4)
    state = curiosity.init(jax.random.key(5), D, CFG)
    batch = jnp.asarray(rng.standard_normal((64, D)), jnp.float32)
    target0 = jax.tree.map(np.asarray, state.target_params)

    @jax.jit
    def train(state):
        return jax.lax.scan(lambda s, _: curiosity.update(s, batch), state, None, length=100)

    new, losses = train(state)
    losses = np.asarray(losses)
    chex.assert_shape(losses, (100,))
    # The loss is the MSE over [M, E]: the mean of the raw errors divided by E.
    np.testing.assert_allclose(losses[0], np.mean(np_raw(state, batch)) / CFG.embed, rtol=1e-4)
    assert losses[-1] < 0.3 * losses[0]
    assert np.all(np.isfinite(losses))
    chex.assert_trees_all_equal(new.target_params, target0)
    assert new.cfg == CFG
    # The learned predictor is less surprised by the batch it trained on than by fresh inputs.
    fresh = jnp.asarray(rng.standard_normal((64, D)) * 3, jnp.float32)
    assert float(jnp.mean(curiosity.prediction_error(new, batch))) < \
        float(jnp.mean(curiosity.prediction_error(new, fresh)))


def test_running_stats_equal_numpy_over_all_values():
    rng = np.random.default_rng(6)
    state = curiosity.init(jax.random.key(0), D, CFG)
    seen = []
    for n in (1, 17, 256, 5, 1000, 3):
        raw = rng.lognormal(rng.uniform(-2, 2), rng.uniform(0.2, 1.5), n) + rng.uniform(0, 50)
        raw = raw.astype(np.float32)
        seen.append(raw.astype(np.float64))
        state = curiosity.update_stats(state, jnp.asarray(raw))
        allv = np.concatenate(seen)
        assert float(state.count) == allv.size
        np.testing.assert_allclose(float(state.mean), allv.mean(), rtol=1e-5)
        np.testing.assert_allclose(float(state.var), allv.var(), rtol=1e-4)


def test_update_stats_rejects_observations():
    state = curiosity.init(jax.random.key(0), D, CFG)
    with pytest.raises(ValueError, match=r"raw prediction errors \[N\]"):
        curiosity.update_stats(state, jnp.zeros((4, D)))

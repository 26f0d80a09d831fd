"""Populations: member i of one vmapped program trains as a single-agent run of member i's seed
and hyperparameters would; exact resume of every member; the run folder's records."""

import json

import jax
import numpy as np
import pytest

from foxhunt_jax import api
from foxhunt_jax.config import load_config, member_config, population_members
from foxhunt_jax.training.population import PopulationTrainer
from foxhunt_jax.training.trainer import Trainer

TINY = ["network.backend=xla", "network.dtype=float32", "network.trunk=[16]", "network.head=8",
        "env.episode_length=8", "train.num_episodes=4", "train.train_steps=3",
        "train.batch_size=8", "replay.capacity=256", "train.validation_windows=4",
        "eval.random_policies=8", "curiosity.hidden=8", "curiosity.embed=4",
        "network.support=explicit", "network.v_min=-5", "network.v_max=5"]


def tiny(*extra):
    return load_config("smoke", TINY + list(extra))


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_each_member_trains_as_its_single_agent_run():
    cfg = tiny("train.population=2", 'population.grid=["train.learning_rate=1e-4,1e-3"]',
               'population.random=["train.gamma=0.8..0.99", "env.cost_bps=0..20", '
               '"curiosity.coef=0.001..0.1:log", "train.n_step=1..5", '
               '"train.epsilon_end=0.0..0.2"]')
    pop = PopulationTrainer.build(cfg)
    state = pop.init_state()
    for _ in range(2):
        state, records, _ = pop.run_epoch(state)
    assert [r["member"] for r in records] == [0, 1]
    members = population_members(cfg)
    assert len({m["train.n_step"] for m in members}) > 1  # a traced n is exercised
    for i, hparams in enumerate(members):
        single = Trainer.build(member_config(cfg, hparams, i))
        s = single.init_state()
        for _ in range(2):
            s, rec = single.run_epoch(s)
        member = jax.tree.map(lambda x: x[i], state.agent.params)
        for a, b in zip(leaves(s.agent.params), leaves(member)):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
        np.testing.assert_allclose(rec["loss"], records[i]["loss"], rtol=1e-4)
        assert rec["epsilon"] == pytest.approx(records[i]["epsilon"])
        assert rec["val"]["sharpe"] == pytest.approx(records[i]["val"]["sharpe"], rel=1e-3,
                                                     abs=1e-4)

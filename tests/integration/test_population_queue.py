"""A population's epochs queued ahead (``PopulationTrainer.run_epoch(queue_next=True)``, what
``api.train`` does between checkpoints) compute what epochs run one at a time compute."""

import jax
import numpy as np

from foxhunt_jax.config import load_config
from foxhunt_jax.training.population import PopulationTrainer
from records import without_timing

TINY = ["network.trunk=[16]", "network.head=16", "network.atoms=5", "curiosity.hidden=8",
        "curiosity.embed=4", "env.episode_length=8", "train.num_episodes=16",
        "train.train_steps=2", "train.population=2", 'population.grid=["train.gamma=0.9,0.99"]']


def test_queued_population_epochs_give_the_same_records_and_state():
    pop = PopulationTrainer.build(load_config("smoke", TINY))

    def run(queues):
        state, records, returns, validated = pop.init_state(), [], [], []
        for queue in queues:
            state, recs, extra = pop.run_epoch(state, queue_next=queue)
            records += recs
            returns.append(extra["window_returns"])
            validated.append(jax.device_get(pop.validated_params))
        return state, records, np.stack(returns), validated

    (s0, r0, w0, v0), (s1, r1, w1, v1) = run([False] * 3), run([True, True, False])
    assert [r["epoch"] for r in r1] == [1, 1, 2, 2, 3, 3]
    assert without_timing(r0) == without_timing(r1)
    np.testing.assert_array_equal(w0, w1)
    # each epoch's validated parameters are its own, queued ahead or not
    for a, b in zip(jax.tree.leaves(v0), jax.tree.leaves(v1)):
        np.testing.assert_array_equal(a, b)
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(v0[0]),
                                                        jax.tree.leaves(v0[1])))
    for a, b in zip(jax.tree.leaves(s0), jax.tree.leaves(s1)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for r in r1:  # each phase from the previous one's completion: never negative
        assert min(r["phase_ms"][k] for k in ("experience", "training", "validation")) >= 0
    # a queued state runs on; any other state drops what was queued and runs its own epoch
    state, recs, _ = pop.run_epoch(pop.init_state(), queue_next=True)
    assert int(state.epoch[0]) == 2 and recs[0]["epoch"] == 1
    state, recs, _ = pop.run_epoch(pop.init_state())
    assert int(state.epoch[0]) == 1 and recs[0]["epoch"] == 1

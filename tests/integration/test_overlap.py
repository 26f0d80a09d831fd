"""train.overlap: Training beside the next epoch's collection, acting one epoch stale."""

import jax
import numpy as np
import pytest

from foxhunt_jax import api
from foxhunt_jax.config import load_config
from foxhunt_jax.errors import ConfigError
from foxhunt_jax.training import checkpoint, phases, pipeline
from foxhunt_jax.training.trainer import Trainer
from records import without_timing

TINY = ["network.trunk=[16]", "network.head=16", "network.atoms=5", "curiosity.hidden=8",
        "curiosity.embed=4", "env.episode_length=8", "train.num_episodes=16",
        "train.train_steps=3", "train.validation_windows=4", "replay.capacity=512",
        "train.epsilon_decay_epochs=2", "train.overlap=true"]


def tiny(*more):
    return load_config("smoke", TINY + list(more))


def assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def trainer():
    return Trainer.build(tiny())


def run(trainer, epochs, queue):
    state, records = trainer.init_state(), []
    for e in range(epochs):
        state, rec = trainer.run_epoch(state, queue_next=queue and e + 1 < epochs)
        records.append(rec)
    return state, records


def test_overlap_is_deterministic_queued_or_not(trainer):
    (s0, r0), (s1, r1) = run(trainer, 3, queue=False), run(trainer, 3, queue=True)
    # on one device an epoch is one program (after the first collection)
    assert sorted(trainer.pipeline.programs) == ["experience", "overlapped"]
    assert without_timing(r0) == without_timing(r1)
    assert [r["epoch"] for r in r1] == [1, 2, 3] and int(s1.epoch) == 3
    assert_trees_equal(s0, s1)
    # Experience times the first collection only; the overlapped program is Training's time
    assert r1[0]["phase_ms"]["experience"] > 0
    assert all(r["phase_ms"]["experience"] == 0 for r in r1[1:])


def test_overlap_with_validation_its_own_program_gives_the_same_epochs(trainer, monkeypatch):
    """On a mesh of several devices Validation stays its own program; forced here on one."""
    s0, r0 = run(trainer, 2, queue=True)
    monkeypatch.setattr(pipeline.Pipeline, "validates_in_overlap", property(lambda self: False))
    apart = Trainer.build(tiny())
    s1, r1 = run(apart, 2, queue=True)
    assert sorted(apart.pipeline.programs) == ["experience", "overlapped", "validation"]
    assert without_timing(r0) == without_timing(r1)
    assert_trees_equal(s0, s1)


def test_overlap_equals_the_phases_in_the_documented_order(trainer):
    """Collection e+1 acts with the agent from before Training(e), its transitions added after
    Training(e); the agent keeps the collection's curiosity statistics."""
    cfg, learner, backend = trainer.cfg, trainer.learner, trainer.backend
    inputs = trainer.pipeline.inputs
    train_params, schedule = inputs.train_env_params, inputs.schedule
    experience = jax.jit(lambda s: phases.experience(learner, backend, cfg, train_params, s,
                                                     schedule))
    training = jax.jit(lambda s: phases.training(learner, cfg, train_params, s, schedule))
    validation = jax.jit(lambda a: phases.validation(learner, backend, cfg,
                                                     inputs.validation_env_params,
                                                     inputs.window_starts, a))
    state, _ = experience(trainer.init_state())  # epoch 1's collection, by the initial agent
    expected = []
    for _ in range(3):
        trained, metrics = training(state)
        collected, stats = experience(trained.replace(agent=state.agent))
        rnd = trained.agent.rnd.replace(count=collected.agent.rnd.count,
                                        mean=collected.agent.rnd.mean,
                                        var=collected.agent.rnd.var)
        state = collected.replace(agent=trained.agent.replace(rnd=rnd))
        _, loss = validation(state.agent)
        expected.append((float(metrics["loss"]), float(stats["epsilon"]),
                         float(stats["reward"]), float(loss)))
    got_state, records = run(trainer, 3, queue=True)
    got = [(r["loss"], r["epsilon"], r["reward"], r["val_loss"]) for r in records]
    assert got == expected
    # each record's collection is the next epoch's: its epsilon is that epoch's
    assert [r["epsilon"] for r in records] == pytest.approx([0.525, 0.05, 0.05])
    assert_trees_equal(got_state, state)


def test_overlap_resume_equals_the_uninterrupted_run(tmp_path):
    quiet = dict(progress=False, log=lambda s: None, final_report=False, log_to=())
    whole = api.train(tiny("train.epochs=3"), tmp_path / "whole", **quiet)

    def stop_after_epoch_2(record):  # called once the epoch's checkpoint is saved
        if record["epoch"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        api.train(tiny("train.epochs=3"), tmp_path / "cut", callbacks=[stop_after_epoch_2],
                  **quiet)
    assert checkpoint.latest_step(tmp_path / "cut" / "checkpoints") == 2
    resumed = api.train(tiny("train.epochs=3"), tmp_path / "cut", resume=True, **quiet)
    assert [r["epoch"] for r in resumed.history] == [1, 2, 3]
    assert without_timing(resumed.history) == without_timing(whole.history)
    assert_trees_equal(resumed.state, whole.state)


def test_overlap_is_refused_for_a_population():
    with pytest.raises(ConfigError, match=r"^config key 'train.overlap' must be false with "
                                          r"train.population 2"):
        tiny("train.population=2")

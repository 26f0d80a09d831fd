"""Data parallelism (foxhunt_jax.parallel): sharded replay, learner and collector against
per-shard references and float64 NumPy; the same run on 1, 2 and 8 forced host devices; restoring
a checkpoint on another device count; shard and multi-process settings."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax import cli, parallel
from foxhunt_jax.agent import replay
from foxhunt_jax.agent.learner import Batch, _update, init_agent, learner_step, make_learner
from foxhunt_jax.config import load_config
from foxhunt_jax.errors import ConfigError
from foxhunt_jax.training.collect import chunked, collect, collect_shards, start, start_shards
from foxhunt_jax.training.trainer import TRADING_ADAPTER, Trainer
from transitions import random_transitions

ROOT = Path(__file__).resolve().parents[2]
# Few and small programs: on a CPU the XLA compile, not the run, is what takes time.
TINY = ["env.episode_length=8", "network.trunk=[16]", "network.head=8", "network.atoms=5",
        "train.num_episodes=16", "train.batch_size=16", "replay.capacity=1024",
        "train.train_steps=3", "train.validation_windows=8", "curiosity.hidden=8",
        "curiosity.embed=4", "train.epsilon_decay_epochs=2"]
# XLA's slowest CPU optimizations off: these programs run once, so compiling is what takes time.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def run_once(fn, *args):
    """``jax.jit(fn)(*args)`` compiled with :data:`FAST_COMPILE`."""
    return jax.jit(fn).lower(*args).compile(FAST_COMPILE)(*args)


# --- settings -------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, key", [
    (["train.shards=0"], "train.shards"),
    (["train.shards=3"], "train.num_episodes"),
    (["train.shards=32", "train.batch_size=48"], "train.batch_size"),
    (["train.shards=8", "replay.capacity=4100"], "replay.capacity"),
])
def test_shards_must_divide_episodes_batch_and_capacity(overrides, key):
    with pytest.raises(ConfigError, match=f"'{key}' must be (>= 1|a multiple of train.shards)"):
        load_config("smoke", overrides)
    assert load_config("smoke", ["train.shards=8"]).train.shards == 8


def test_distributed_spec_from_flags_and_environment():
    env = {"FOXHUNT_COORDINATOR": "10.0.0.1:1234", "FOXHUNT_NUM_PROCESSES": "4",
           "FOXHUNT_PROCESS_ID": "3"}
    assert parallel.distributed_spec(environ={}) is None
    assert parallel.distributed_spec(environ=env) == parallel.DistributedSpec("10.0.0.1:1234", 4, 3)
    # flags win over the environment
    flags = parallel.distributed_spec("h:9", 2, 0, environ=env)
    assert flags == parallel.DistributedSpec("h:9", 2, 0)
    assert parallel.distributed_spec(mode="auto", environ={}) == parallel.DistributedSpec(auto=True)
    assert parallel.distributed_spec(mode="off", environ=env) is None
    assert parallel.distributed_spec(environ={"FOXHUNT_DISTRIBUTED": "auto",
                                              "FOXHUNT_PROCESS_ID": "1"}).process_id == 1
    for kwargs, needle in [({"coordinator": "h:1"}, "--num-processes, --process-id"),
                           ({"coordinator": "nohost", "num_processes": 2, "process_id": 0},
                            "HOST:PORT"),
                           ({"coordinator": "h:1", "num_processes": 2, "process_id": 2},
                            "--process-id must be in 0..1"),
                           ({"coordinator": "h:1", "num_processes": "x", "process_id": 0},
                            "--num-processes must be an integer"),
                           ({"mode": "sometimes"}, "--distributed")]:
        with pytest.raises(ConfigError, match=needle):
            parallel.distributed_spec(environ={}, **kwargs)


def test_processes_wait_for_each_other_at_numbered_barriers(monkeypatch):
    """``wait_for_all_processes`` returns at once alone; in a run of several processes it
    waits at the coordination service's barrier, each call a barrier of its own (its number,
    then what it waits for) with the timeout in milliseconds."""
    calls = []
    client = SimpleNamespace(wait_at_barrier=lambda key, timeout_in_ms: calls.append(
        (key, timeout_in_ms)))
    monkeypatch.setattr(parallel, "_coordination_client", lambda: client)
    parallel.wait_for_all_processes("alone")
    assert calls == []  # one process: nothing to wait for
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    parallel.wait_for_all_processes("programs", timeout_s=5)
    parallel.wait_for_all_processes("programs")
    (k1, t1), (k2, t2) = calls
    assert k1 != k2 and k1.endswith("/programs") and k2.endswith("/programs")
    assert int(k2.split("/")[1]) == int(k1.split("/")[1]) + 1
    assert (t1, t2) == (5000, parallel.BARRIER_TIMEOUT_S * 1000)


def test_cli_bad_multiprocess_flags_are_one_line_errors(capsys, tmp_path):
    code = cli.main(["train", "--coordinator", "127.0.0.1:1", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and "--process-id" in err[0]
    assert not (tmp_path / "x").exists()


def test_mesh_places_shards_and_replicates_the_rest():
    mesh = parallel.make_mesh(4)
    assert mesh.axis_names == (parallel.DATA,) and mesh.devices.size == 1
    with pytest.raises(ConfigError, match="train.shards"):
        parallel.make_mesh(0)
    keys = parallel.shard_keys(jax.random.PRNGKey(7), 3)
    for s in range(3):
        np.testing.assert_array_equal(keys[s], jax.random.fold_in(jax.random.PRNGKey(7), s))
    x = parallel.put_replicated({"a": np.arange(6.0).reshape(2, 3)}, mesh)
    assert x["a"].sharding.is_fully_replicated
    np.testing.assert_array_equal(parallel.to_host(x)["a"], np.arange(6.0).reshape(2, 3))


# --- sharded replay: per-shard rings, global weights ---------------------------------------------

def _items(rng, n):
    return {"x": jnp.asarray(rng.normal(size=(n, 3)), jnp.float32),
            "i": jnp.asarray(rng.integers(0, 100, size=n), jnp.int32)}


def test_sharded_replay_matches_per_shard_buffers_and_float64_weights():
    rng = np.random.default_rng(0)
    s, cap, n, m, alpha, beta = 4, 64, 40, 16, 0.7, 0.5
    one_item = jax.tree.map(lambda x: x[0], _items(rng, 1))
    state = replay.init_shards(one_item, s * cap, s)
    chex.assert_shape([state.priorities], (s, cap))
    chex.assert_shape(state.items["x"], (s, cap, 3))
    # jitted so that each function compiles once (eager ops would compile one by one)
    add_s = jax.jit(lambda st, it, p: replay.add_shards(st, it, p, alpha))
    add_1 = jax.jit(lambda st, it, p: replay.add(st, it, p, alpha))
    sample_1 = jax.jit(lambda st, k: replay.sample(st, k, m // s, beta))
    update_1 = jax.jit(lambda st, i, p: replay.update_priorities(st, i, p, alpha))
    plain = [replay.init(one_item, cap) for _ in range(s)]
    for _ in range(2):  # the second add wraps around each ring
        items = _items(rng, s * n)
        raw = rng.gamma(0.5, 2.0, size=s * n).astype(np.float32)
        shaped = jax.tree.map(lambda x: x.reshape((s, n) + x.shape[1:]), items)
        state = add_s(state, shaped, jnp.asarray(raw).reshape(s, n))
        plain = [add_1(p, jax.tree.map(lambda x: x[k * n:(k + 1) * n], items),
                       raw[k * n:(k + 1) * n]) for k, p in enumerate(plain)]
    for k in range(s):
        chex.assert_trees_all_close(jax.tree.map(lambda x: x[k], state), plain[k])

    key = jax.random.PRNGKey(3)
    got, idx, w = jax.jit(lambda st, k: replay.sample_shards(st, k, m, beta))(state, key)
    chex.assert_shape([idx, w], (s, m // s))
    q = np.asarray(state.priorities, np.float64)
    size = np.asarray(state.size, np.float64)
    unnorm = np.empty((s, m // s))
    for k in range(s):
        ref_items, ref_idx, _ = sample_1(plain[k], jax.random.fold_in(key, k))
        np.testing.assert_array_equal(idx[k], ref_idx)
        chex.assert_trees_all_equal(jax.tree.map(lambda x: x[k], got), ref_items)
        unnorm[k] = (size[k] * q[k, ref_idx] / q[k].sum()) ** -beta
    np.testing.assert_allclose(np.asarray(w), unnorm / unnorm.max(), rtol=2e-5)

    new = rng.gamma(0.5, 2.0, size=(s, m // s)).astype(np.float32)
    state = jax.jit(lambda st, i, p: replay.update_priorities_shards(st, i, p, alpha))(
        state, idx, jnp.asarray(new))
    for k in range(s):
        ref = update_1(plain[k], idx[k], new[k])
        np.testing.assert_array_equal(state.priorities[k], ref.priorities)
    with pytest.raises(ConfigError, match="train.batch_size 10"):
        replay.sample_shards(state, key, 10, beta)
    with pytest.raises(ConfigError, match="per shard"):
        jax.eval_shape(replay.add_shards, state,
                       jax.tree.map(lambda x: jnp.repeat(x[:, :1], cap + 1, 1), shaped))


# --- sharded learner step: one update on the global batch ----------------------------------------

def test_sharded_learner_step_is_one_update_on_the_global_batch():
    cfg = load_config(None, ["network.trunk=[16]", "network.head=8", "network.atoms=5",
                             "train.batch_size=8", "replay.alpha=0.6", "curiosity.hidden=8",
                             "curiosity.embed=4"])
    learner = make_learner(cfg, (3, 2))
    rng = np.random.default_rng(1)
    d, n, s = 5, 24, 2
    items = random_transitions(rng, n, d, (3, 2))
    decode = lambda it: (it["obs"], it["next_obs"])
    key, beta = jax.random.PRNGKey(5), jnp.float32(0.6)
    raw = rng.gamma(1.0, 1.0, n).astype(np.float32)

    def both(items, raw, key):
        """The sharded step, and its reference: one update on the M drawn items as one batch."""
        agent = init_agent(jax.random.PRNGKey(0), learner, d)
        buffer = replay.init_shards(jax.tree.map(lambda x: x[0], items), 32, s)
        split = lambda x: x.reshape((s, n // s) + x.shape[1:])
        buffer = replay.add_shards(buffer, jax.tree.map(split, items), split(raw), 0.6)
        new_agent, new_buffer, m = learner_step(learner, decode, agent, buffer, key, beta)
        drawn, idx, w = replay.sample_shards(buffer, key, 8, beta)
        flat = lambda x: x.reshape((-1,) + x.shape[2:])
        drawn = jax.tree.map(flat, drawn)
        ref_agent, losses, ref_m, _ = _update(learner, agent, Batch(*decode(drawn), drawn, idx,
                                                                    flat(w)))
        return (new_agent, new_buffer, m), (ref_agent, losses, ref_m, idx, flat(w))

    (a2, b2, m2), (ref_agent, losses, ref_m, idx, w) = run_once(both, items, raw, key)
    chex.assert_shape([idx], (s, 4))
    chex.assert_trees_all_close((a2, m2), (ref_agent, ref_m), rtol=1e-5, atol=1e-7)
    # the loss is the weighted mean over the global batch (float64), weights normalized over it
    assert float(np.max(w)) == 1.0
    np.testing.assert_allclose(float(m2["loss"]),
                               np.mean(np.asarray(w, np.float64) * np.asarray(losses)), rtol=1e-5)
    for k in range(s):  # each shard's drawn slots get (|loss| + eps) ** alpha, last draw wins
        q = (np.abs(np.asarray(losses[4 * k:4 * (k + 1)], np.float64)) + 1e-6) ** 0.6
        ref = dict(zip(np.asarray(idx[k]).tolist(), q))
        np.testing.assert_allclose(np.asarray(b2.priorities[k])[list(ref)], list(ref.values()),
                                   rtol=1e-5)


@pytest.mark.parametrize("m, most, calls", [
    (11, 4, 3),  # a padded last chunk
    (11, 11, 1), (11, 64, 1),  # an exact fit, a single call
    (1000, 768, 2),  # two chunks of 512 rows (128-row multiples), not 768 and 232
])
def test_chunked_priorities_equal_one_pass(m, most, calls):
    rng = np.random.default_rng()
    items = {"a": rng.normal(size=(m, 3)).astype(np.float32),
             "b": rng.integers(0, 5, size=m).astype(np.int32)}
    sizes = []

    def fn(it):
        sizes.append(it["a"].shape[0])
        return jnp.sum(jnp.square(it["a"]), axis=1) * it["b"]

    ref = np.sum(np.square(items["a"].astype(np.float64)), axis=1) * items["b"]
    out = chunked(fn, items, most)
    chex.assert_shape(out, (m,))
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    assert max(sizes) <= most and -(-m // sizes[0]) == calls  # lax.map traces fn once
    # a pytree of [M, ...] results (next_greedy's actions [M, B])
    pair = chunked(lambda it: (it["a"] * 2.0, it["b"]), items, most)
    chex.assert_shape(pair, ((m, 3), (m,)))
    np.testing.assert_array_equal(pair[1], items["b"])
    np.testing.assert_allclose(pair[0], 2.0 * items["a"], rtol=1e-6)


# --- sharded collection: per-shard episodes, global curiosity statistics -------------------------

@pytest.mark.parametrize("backend", [
    [],
    # the rollout kernel and the fused logits forward of the priorities, both batched over the
    # shard axis (Pallas' vmap rule; interpret mode on the CPU)
    ["network.dtype=bfloat16", "network.backend=pallas"],
])
def test_collect_shards_equals_per_shard_collect_with_pooled_rnd_statistics(backend):
    cfg = load_config("smoke", TINY + ["train.shards=2"] + backend)
    tr = Trainer.build(cfg)
    params, learner, s, steps = tr.env_params["train"], tr.learner, 2, 4
    key, eps = jax.random.PRNGKey(11), jnp.float32(0.3)

    def both(key):
        """Sharded collection, and plain collection of each shard with its fold_in key."""
        agent = init_agent(jax.random.PRNGKey(0), learner, tr.obs_dim)
        rollouts = start_shards(TRADING_ADAPTER, params, key, s, 16)
        out = collect_shards(learner, tr.backend, TRADING_ADAPTER, params, agent, rollouts, key,
                             eps, steps)
        keys = parallel.shard_keys(key, s)
        per_shard = jax.vmap(lambda k: collect(learner, tr.backend, TRADING_ADAPTER, params, agent,
                                               start(TRADING_ADAPTER, params, k, 8), k, eps,
                                               steps))(keys)
        return out, per_shard

    out, ref = run_once(both, key)
    (rollouts, items, prio, rnd, stats), (ref_r, ref_items, ref_prio, ref_rnd, ref_stats) = out, ref
    chex.assert_shape(prio, (s, steps * 8))
    chex.assert_trees_all_close((rollouts, items, prio), (ref_r, ref_items, ref_prio), rtol=1e-5,
                                atol=1e-6)
    # the curiosity statistics pool every shard's novelty: equal-sized groups, float64 reference
    means = np.asarray(ref_rnd.mean, np.float64)
    variances = np.asarray(ref_rnd.var, np.float64)
    assert float(rnd.count) == float(np.sum(ref_rnd.count)) == s * steps * 8
    np.testing.assert_allclose(float(rnd.mean), means.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(rnd.var), variances.mean() + means.var(), rtol=1e-4)
    np.testing.assert_allclose(float(stats["reward"]), np.mean(ref_stats["reward"]), rtol=1e-5,
                               atol=1e-7)
    assert int(stats["episodes_done"]) == int(np.sum(ref_stats["episodes_done"]))


# --- 1, 2 and 8 devices: same results; checkpoint restored onto another device count ------------

DEVICE_SCRIPT = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    from foxhunt_jax.jitcache import enable_compilation_cache
    enable_compilation_cache()
    import jax
    from foxhunt_jax import api
    from foxhunt_jax.config import load_config
    from foxhunt_jax.errors import ConfigError
    from foxhunt_jax.training import checkpoint
    from foxhunt_jax.training.trainer import Trainer

    overrides, ckpt = json.loads(sys.argv[1]), Path(sys.argv[2])
    cfg = load_config("smoke", overrides + ["train.epochs=3"])
    devs = jax.devices()
    strip = lambda rec: {k: v for k, v in rec.items() if k != "phase_ms"}
    result = {"devices": len(devs)}
    # 1 device: three epochs
    res = api.train(cfg, None, final_report=False, devices=devs[:1], log=lambda s: None)
    result["one"] = [strip(r) for r in res.history]
    # 8 devices: two epochs, then a checkpoint
    tr = Trainer.build(cfg, devices=devs)
    state, recs = tr.init_state(), []
    for _ in range(2):
        state, rec = tr.run_epoch(state)
        recs.append(strip(rec))
    result["eight"] = recs
    result["buffer_spec"] = list(state.buffer.priorities.sharding.spec)
    result["local_shards"] = [s.data.shape[0] for s in state.buffer.priorities.addressable_shards]
    result["params_replicated"] = all(x.sharding.is_fully_replicated
                                      for x in jax.tree.leaves(state.agent.params))
    hlo = tr.pipeline.programs["training"].as_text()
    result["all_reduce"], result["all_gather"] = "all-reduce" in hlo, "all-gather" in hlo
    # collection runs inside shard_map: each device over its own shards (Pallas kernels are
    # opaque to XLA's partitioner, which would otherwise run them over every shard everywhere)
    exp_fn, exp_args = tr.phase_programs(state)["experience"]
    lowered = exp_fn.lower(*exp_args).as_text()
    result["collect_per_device"] = ("manual_computation" in lowered
                                    or "SPMDFullToShardShape" in lowered)
    checkpoint.save(ckpt, 2, state, {"epoch": 2})
    # 2 devices: the third epoch from the 8-device checkpoint, restored onto the 2-device mesh
    tr2 = Trainer.build(cfg, devices=devs[:2])
    state2, _ = checkpoint.restore(ckpt, 2, tr2.init_state())
    result["restored_devices"] = len(state2.buffer.priorities.sharding.device_set)
    state2, rec = tr2.run_epoch(state2)
    result["two"] = [strip(rec)]
    try:
        Trainer.build(load_config("smoke", overrides + ["train.shards=4"]), devices=devs)
    except ConfigError as e:
        result["error"] = str(e)
    # the default devices: train.shards=1 (a config's default) starts on one of the 8 and says so
    from foxhunt_jax import parallel
    single = Trainer.build(load_config("smoke", overrides + ["train.shards=1"]))
    result["default_devices"] = int(single.mesh.devices.size)
    result["note"] = parallel.unused_devices_note(single.mesh, 1)
    print("RESULT " + json.dumps(result))
''')

COMPARED = ("loss", "grad_norm", "rnd_loss", "reward", "bonus", "val_loss")


def assert_same_learning(a, b):
    assert [r["epoch"] for r in a] == [r["epoch"] for r in b]
    for ra, rb in zip(a, b):
        np.testing.assert_allclose([ra[k] for k in COMPARED], [rb[k] for k in COMPARED],
                                   rtol=1e-5, atol=1e-7)
        for k in ("total_return", "sharpe", "max_drawdown", "turnover", "trades"):
            np.testing.assert_allclose(ra["val"][k], rb["val"][k], rtol=1e-4, atol=1e-6)


def test_same_result_on_1_2_and_8_devices_and_restore_on_another_count(tmp_path):
    # FAST_COMPILE as flags: the subprocess compiles the phases for three meshes.
    flags = ("--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
             "--xla_llvm_disable_expensive_passes=true")
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    overrides = TINY + ["train.shards=8"]
    r = subprocess.run([sys.executable, "-c", DEVICE_SCRIPT, json.dumps(overrides),
                        str(tmp_path / "ckpt")], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert res["devices"] == 8
    # S = 8 shards: epochs 1-2 on 8 devices, epoch 3 on 2 devices after the checkpoint moved
    # there, against 1 device throughout
    assert_same_learning(res["one"][:2], res["eight"])
    assert_same_learning(res["one"][2:], res["two"])
    assert res["restored_devices"] == 2
    # 8 devices: one shard each, the agent replicated, gradients all-reduced, nothing gathered
    assert res["buffer_spec"] == ["data"] and res["local_shards"] == [1] * 8
    assert res["params_replicated"] and res["all_reduce"] and not res["all_gather"]
    assert res["collect_per_device"]
    assert "train.shards" in res["error"] and "device count 8" in res["error"]
    assert res["default_devices"] == 1
    assert "1 of this host's 8 devices" in res["note"] and "multiple of 8" in res["note"]

"""orbax checkpoints: round trip, typed PRNG keys, atomicity, retention, damaged steps that fall
back to the newest intact one, the non-finite guard."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import chex
import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from foxhunt_jax.errors import FoxhuntError, NonFiniteError
from foxhunt_jax.training import checkpoint as ckpt


@flax.struct.dataclass
class Learner:
    params: dict
    opt_state: optax.OptState
    key: jax.Array  # new-style typed key
    raw_key: jax.Array  # legacy uint32 [2] key
    step: jax.Array
    epoch: int  # plain Python int leaf
    counts: np.ndarray
    lr: float


def make_state(seed: int) -> Learner:
    rng = np.random.default_rng(seed)
    params = {"trunk_0": {"kernel": jnp.asarray(rng.normal(size=(5, 7)), jnp.float32),
                          "bias": jnp.asarray(rng.normal(size=7), jnp.float32)},
              "head": {"kernel": jnp.asarray(rng.normal(size=(7, 3)), jnp.bfloat16)}}
    adam, rest = optax.adam(1e-3).init(params)
    moments = lambda: jax.tree.map(  # noqa: E731  non-zero moments, built without compiling
        lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
    opt_state = (adam._replace(count=jnp.asarray(seed, jnp.int32), mu=moments(), nu=moments()),
                 rest)
    return Learner(params=params, opt_state=opt_state,
                   key=jax.random.split(jax.random.key(seed), 3),
                   raw_key=jax.random.PRNGKey(seed + 100),
                   step=jnp.asarray(seed * 7, jnp.int32), epoch=seed,
                   counts=rng.integers(0, 1000, 4).astype(np.int64), lr=0.5 + seed)


def assert_same_state(got: Learner, want: Learner) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert jax.dtypes.issubdtype(got.key.dtype, jax.dtypes.prng_key)
    assert jax.random.key_impl(got.key) == jax.random.key_impl(want.key)
    np.testing.assert_array_equal(jax.random.key_data(got.key), jax.random.key_data(want.key))
    # the restored key draws the same numbers
    np.testing.assert_array_equal(jax.random.uniform(got.key[1], (4,)),
                                  jax.random.uniform(want.key[1], (4,)))
    rest = lambda s: s.replace(key=jax.random.key_data(s.key))  # noqa: E731
    for g, w in zip(jax.tree.leaves(rest(got)), jax.tree.leaves(rest(want))):
        assert type(g) is type(w) or (isinstance(g, jax.Array) and isinstance(w, jax.Array))
        assert np.asarray(g).dtype == np.asarray(w).dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    chex.assert_trees_all_equal(rest(got), rest(want))


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


def test_round_trip_nested_state(tmp_path):
    state = make_state(1)
    meta = {"epoch": 3, "config": {"train": {"epochs": 30}}, "note": "x", "best": np.float32(1.5)}
    ckpt.save(tmp_path, 3, state, meta)
    assert ckpt.latest_step(tmp_path) == 3
    target = make_state(2)  # same structure, different values: only structure is used
    got, got_meta = ckpt.restore(tmp_path, 3, target)
    assert_same_state(got, state)
    assert got_meta == {"epoch": 3, "config": {"train": {"epochs": 30}}, "note": "x", "best": 1.5}
    assert isinstance(got.epoch, int) and isinstance(got.lr, float)
    # arrays and JSON only: nothing in the checkpoint can run code when read
    names = [p.name.lower() for p in files_under(tmp_path)]
    assert names and not [n for n in names if n.endswith((".pkl", ".pickle")) or "pickle" in n]
    for p in files_under(tmp_path):
        assert b"\x80\x04\x95" not in p.read_bytes()[:3]  # no pickle protocol-4 header


def test_restore_keeps_target_sharding_and_shape_dtype_targets(tmp_path):
    state = make_state(4)
    ckpt.save(tmp_path, 1, state, {})
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                         sharding=getattr(x, "sharding", None))
                          if isinstance(x, jax.Array) else x, make_state(5))
    got, _ = ckpt.restore(tmp_path, None, target)
    assert_same_state(got, state)
    assert got.params["trunk_0"]["kernel"].sharding == state.params["trunk_0"]["kernel"].sharding


def _saved_layout(ckpt_dir, step: int) -> dict:
    import orbax.checkpoint as ocp

    mgr = ckpt._manager(ckpt_dir, read_only=True)
    try:
        return mgr.restore(step, args=ocp.args.Composite(layout=ocp.args.JsonRestore()))["layout"]
    finally:
        mgr.close()


def test_replicated_leaves_are_packed_and_unpacked_checkpoints_restore(tmp_path, monkeypatch):
    state = make_state(6)
    ckpt.save(tmp_path / "packed", 1, state, {})
    layout = _saved_layout(tmp_path / "packed", 1)
    packed = [e for e in layout["leaves"] if "pack" in e]
    # float32, bfloat16, int32 and uint32 (key data) groups of two or more leaves
    assert {p["dtype"] for p in layout["packs"]} == {"float32", "bfloat16", "int32", "uint32"}
    assert len(packed) >= 8 and len(layout["packs"]) == 4
    for j, pack in enumerate(layout["packs"]):  # each pack is its members end to end
        sizes = [int(np.prod(e["shape"])) for e in packed if e["pack"][0] == j]
        assert pack["size"] == sum(sizes)
    assert_same_state(ckpt.restore(tmp_path / "packed", 1, make_state(0))[0], state)
    # a checkpoint written leaf by leaf (as before packing) restores the same
    monkeypatch.setattr(ckpt, "_pack_group", lambda value: None)
    ckpt.save(tmp_path / "plain", 1, state, {})
    assert not _saved_layout(tmp_path / "plain", 1)["packs"]
    monkeypatch.undo()
    assert_same_state(ckpt.restore(tmp_path / "plain", 1, make_state(0))[0], state)


def test_keeps_last_two_and_latest(tmp_path):
    assert ckpt.latest_step(tmp_path / "missing") is None
    assert not (tmp_path / "missing").exists()
    for step in (1, 2, 3, 5):
        ckpt.save(tmp_path, step, make_state(step), {"epoch": step})
    assert ckpt.all_steps(tmp_path) == [3, 5]
    got, meta = ckpt.restore(tmp_path, 3, make_state(0))
    assert meta == {"epoch": 3}
    assert_same_state(got, make_state(3))
    with pytest.raises(FoxhuntError, match="no checkpoint of step 1"):
        ckpt.restore(tmp_path, 1, make_state(0))


def test_saving_an_existing_step_replaces_it(tmp_path):
    ckpt.save(tmp_path, 2, make_state(1), {"v": 1})
    ckpt.save(tmp_path, 2, make_state(2), {"v": 2})
    got, meta = ckpt.restore(tmp_path, 2, make_state(0))
    assert meta == {"v": 2}
    assert_same_state(got, make_state(2))


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    good = make_state(1)
    ckpt.save(tmp_path, 1, good, {"epoch": 1})

    def failing_save(self, item, directory):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "metadata").write_text('{"epoch": ')  # half-written, then the crash
        raise OSError("simulated crash while writing")

    with monkeypatch.context() as m:
        m.setattr(ocp.handlers.JsonCheckpointHandler, "_save_fn", failing_save)
        with pytest.raises(Exception):
            ckpt.save(tmp_path, 2, make_state(2), {"epoch": 2})
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith("2")]
    assert leftovers and all("tmp" in n for n in leftovers)  # partial step 2 is a temp dir
    # A real crash ends the process; here the state item's writes of the failed save go on in
    # orbax's threads for a moment, and the cleanup below must not race with them.
    def listing():
        try:
            return sorted((str(p), p.stat().st_size) for p in tmp_path.rglob("*") if p.is_file())
        except FileNotFoundError:  # a file renamed while listed: still moving
            return None

    before, deadline = None, time.time() + 10
    while (listing() != before or before is None) and time.time() < deadline:
        before = listing()
        time.sleep(0.3)
    assert ckpt.latest_step(tmp_path) == 1
    got, meta = ckpt.restore(tmp_path, None, make_state(0))
    assert meta == {"epoch": 1}
    assert_same_state(got, good)
    # the next save works and clears the leftovers
    ckpt.save(tmp_path, 2, make_state(2), {"epoch": 2})
    assert ckpt.all_steps(tmp_path) == [1, 2]
    assert not [p for p in tmp_path.iterdir() if "tmp" in p.name]


KILL_SCRIPT = textwrap.dedent("""
    import sys, jax.numpy as jnp
    from foxhunt_jax.training import checkpoint as ckpt
    for step in range(1, 10_000):
        big = jnp.full((1024, 1024), float(step), jnp.float32)  # 4 MB per step
        ckpt.save(sys.argv[1], step, {"w": big, "step": jnp.int32(step)}, {"step": step})
        print(step, flush=True)
""")


def test_sigkill_during_saves_leaves_a_complete_checkpoint(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for _ in range(3):  # let a few saves complete, then kill during the next ones
            assert proc.stdout.readline().strip(), "the saving process died early"
        time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    step = ckpt.latest_step(tmp_path)
    assert step is not None and step >= 3
    target = {"w": jnp.zeros((1024, 1024), jnp.float32), "step": jnp.int32(0)}
    got, meta = ckpt.restore(tmp_path, step, target)
    assert meta == {"step": step} and int(got["step"]) == step
    np.testing.assert_array_equal(np.asarray(got["w"]), np.full((1024, 1024), float(step)))


def test_layout_mismatch_is_one_line_error(tmp_path):
    ckpt.save(tmp_path, 1, {"a": jnp.ones((2, 3)), "k": jax.random.key(0)}, {})
    with pytest.raises(FoxhuntError,
                       match=r"leaf 'a' has shape \[2, 3\], this run expects \[4, 3\]"):
        ckpt.restore(tmp_path, 1, {"a": jnp.ones((4, 3)), "k": jax.random.key(0)})
    with pytest.raises(FoxhuntError, match="leaf 'k' has kind prng_key"):
        ckpt.restore(tmp_path, 1, {"a": jnp.ones((2, 3)), "k": jax.random.PRNGKey(0)})
    with pytest.raises(FoxhuntError, match="holds 2 arrays, this run's state has 1"):
        ckpt.restore(tmp_path, 1, {"a": jnp.ones((2, 3))})
    with pytest.raises(FoxhuntError, match="no checkpoint in"):
        ckpt.restore(tmp_path / "empty", None, {"a": jnp.ones((2, 3))})


def test_a_subtree_restores_whatever_the_rest_of_the_layout(tmp_path):
    """``prefix``: the network of a state whose optimizer was saved in another layout (the
    moments raveled, as before agent/optimizer.py) restores; only the subtree is checked."""
    state = make_state(2)
    flat_moments = optax.flatten(optax.adam(1e-3)).init(state.params)
    saved = {"agent": {"params": state.params, "opt_state": flat_moments},
             "replay": jnp.arange(12.0).reshape(3, 4), "key": jax.random.key(3)}
    ckpt.save(tmp_path, 4, saved, {"epoch": 4})
    wanted = jax.tree.map(jnp.zeros_like, state.params)
    params, meta = ckpt.restore(tmp_path, 4, wanted, prefix="agent/params")
    chex.assert_trees_all_equal(params, state.params)
    chex.assert_trees_all_equal_shapes_and_dtypes(params, wanted)
    assert meta["epoch"] == 4
    with pytest.raises(FoxhuntError, match="holds"):  # the whole state: another layout
        ckpt.restore(tmp_path, 4, {"agent": {"params": wanted,
                                             "opt_state": optax.adam(1e-3).init(wanted)},
                                   "replay": jnp.zeros((3, 4)), "key": jax.random.key(0)})
    with pytest.raises(FoxhuntError, match="leaf 'head/kernel' has shape"):
        ckpt.restore(tmp_path, 4, {**wanted, "head": {"kernel": jnp.zeros((7, 4))}},
                     prefix="agent/params")
    replay, _ = ckpt.restore(tmp_path, 4, jnp.zeros((3, 4)), prefix="replay")
    np.testing.assert_array_equal(replay, np.arange(12.0).reshape(3, 4))


def test_assert_finite_names_epoch_quantity_and_leaf():
    good = {"trunk_0": {"kernel": jnp.ones((2, 2)), "bias": jnp.zeros(2)},
            "count": jnp.int32(3), "key": jax.random.key(0)}
    ckpt.assert_finite(good, "params", 1)  # ints and keys are skipped
    ckpt.assert_finite(jnp.float32(0.3), "loss", 1)

    with pytest.raises(NonFiniteError, match=r"^epoch 3: loss is NaN$"):
        ckpt.assert_finite(jnp.float32(np.nan), "loss", 3)
    with pytest.raises(NonFiniteError, match=r"^epoch 4: loss is Inf$"):
        ckpt.assert_finite(np.float64(-np.inf), "loss", 4)
    bad = {"head": {"kernel": jnp.ones(2)},
           "trunk_0": {"bias": jnp.zeros(2), "kernel": jnp.array([[1.0, np.inf], [0, 1]])},
           "trunk_1": {"kernel": jnp.array([np.nan])}}
    with pytest.raises(NonFiniteError,
                       match=r"^epoch 3: params contain Inf \(leaf 'trunk_0/kernel'\)$"):
        ckpt.assert_finite(bad, "params", 3)
    state = make_state(1)
    state = state.replace(opt_state=jax.tree.map(
        lambda x: x.at[0].set(jnp.nan) if x.ndim == 1 and x.dtype == jnp.float32 else x,
        state.opt_state))
    with pytest.raises(NonFiniteError, match=r"epoch 7: learner state contains NaN "
                                             r"\(leaf 'opt_state/0/mu/trunk_0/bias'\)"):
        ckpt.assert_finite(state, "learner state", 7)
    assert NonFiniteError("x").exit_code == 3


SHARDED_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from foxhunt_jax.training import checkpoint as ckpt
    mesh = jax.make_mesh((2,), ("d",))
    split, rep = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
    state = {"w": jax.device_put(jnp.arange(8.0).reshape(4, 2), split),
             "keys": jax.device_put(jax.random.split(jax.random.key(0), 4), split),
             "key": jax.device_put(jax.random.key(3), rep),
             # replicated, one dtype: stored as one pack
             "a": jax.device_put(jnp.arange(6.0).reshape(2, 3), rep),
             "b": jax.device_put(jnp.float32(7.0), rep)}
    ckpt.save(sys.argv[1], 1, state, {})
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            state)
    for target in (jax.tree.map(lambda x: x, state), abstract):
        got, _ = ckpt.restore(sys.argv[1], 1, target)
        for k in state:
            assert got[k].sharding == state[k].sharding, k
        for k in ("w", "a", "b"):
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(state[k]))
        for k in ("keys", "key"):
            np.testing.assert_array_equal(jax.random.key_data(got[k]),
                                          jax.random.key_data(state[k]))
    print("ok")
""")


def test_sharded_state_round_trip_on_two_devices(tmp_path):
    out = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT, str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _damage(step_dir: Path, how: str) -> str:
    """Damages one file of a saved step; returns its path relative to the step."""
    if how == "layout":
        path = step_dir / "layout" / "metadata"
        path.write_text(path.read_text()[:-30] + "]]")
    elif how == "missing":
        path = next(p for p in (step_dir / "metadata").iterdir() if p.name == "metadata")
        path.unlink()
    else:
        path = max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
                   key=lambda p: p.stat().st_size)
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 3] if how == "truncate" else
                         data[:64] + bytes(b ^ 0xFF for b in data[64:96]) + data[96:])
    return str(path.relative_to(step_dir))


# without digests (steps saved before them) only what orbax cannot read is noticed: no "garble"
@pytest.mark.parametrize("how, digests", [("truncate", True), ("garble", True), ("layout", True),
                                          ("missing", True), ("truncate", False),
                                          ("layout", False), ("missing", False)])
def test_damaged_latest_checkpoint_is_skipped_with_one_warning(tmp_path, how, digests):
    for step in (1, 2):
        ckpt.save(tmp_path, step, make_state(step), {"epoch": step})
    assert ckpt.verify(tmp_path, 2)
    if not digests:  # a step saved before digests existed is checked by reading it
        (tmp_path / "2" / ckpt.DIGESTS_FILE).unlink()
        assert not ckpt.verify(tmp_path, 2)
    name = _damage(tmp_path / "2", how)
    with pytest.raises(ckpt.DamagedCheckpoint, match=f"checkpoint {tmp_path}/2"):
        ckpt.restore(tmp_path, 2, make_state(0))
    if digests:
        with pytest.raises(ckpt.DamagedCheckpoint, match=f"file {re.escape(name)}"):
            ckpt.verify(tmp_path, 2)
    warnings = []
    got, meta, step = ckpt.restore_latest(tmp_path, make_state(0), warn=warnings.append)
    assert step == 1 and meta == {"epoch": 1}
    assert_same_state(got, make_state(1))
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: checkpoint {tmp_path}/2")
    assert "\n" not in warnings[0]


def test_no_intact_checkpoint_is_one_error_and_a_layout_change_is_not_damage(tmp_path):
    for step in (1, 2):
        ckpt.save(tmp_path, step, make_state(step), {"epoch": step})
    with pytest.raises(FoxhuntError, match="holds 16 arrays") as err:  # not skipped: no fallback
        ckpt.restore_latest(tmp_path, {"a": jnp.ones(2), "b": jnp.ones(3)})
    assert not isinstance(err.value, ckpt.DamagedCheckpoint)
    _damage(tmp_path / "2", "truncate")
    _damage(tmp_path / "1", "layout")
    warnings = []
    with pytest.raises(FoxhuntError,
                       match=r"no intact checkpoint in .* \(steps 1, 2 are damaged\)"):
        ckpt.restore_latest(tmp_path, make_state(0), warn=warnings.append)
    assert len(warnings) == 2

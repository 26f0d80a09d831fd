"""The executable cache (foxhunt_jax/jitcache.py): a loaded program computes what the compiled
one does, keys change with what determines the program, bad entries are recompiled."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax import jitcache
from foxhunt_jax.config import load_config
from foxhunt_jax.training.trainer import Trainer
from records import without_timing

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def exe_dir(tmp_path):
    """The executable cache on, in a fresh folder, beside the suite's JAX cache: a program that
    cache serves is stored as one XLA compiles is."""
    folder, saved = tmp_path / "executables", jitcache.executable_cache_folder()
    jitcache.set_executable_cache(folder)
    yield folder
    jitcache.set_executable_cache(saved)


def test_trainer_phases_load_from_the_cache_and_compute_the_same(exe_dir):
    cfg = load_config("smoke")
    runs = []
    for _ in range(2):
        tr = Trainer.build(cfg)
        state = tr.init_state()
        tr.compile(state)
        loaded = tr.executables_loaded
        recs = []
        for _ in range(2):
            state, rec = tr.run_epoch(state)
            recs.append(rec)
        runs.append((loaded, without_timing(recs), jax.device_get(state.agent.params)))
    (loaded0, recs0, params0), (loaded1, recs1, params1) = runs
    assert (loaded0, loaded1) == (0, 3)
    assert sorted(p.name.split("-")[0] for p in exe_dir.iterdir()) == [
        "experience", "init_agent", "init_state", "training", "validation"]
    assert recs0 == recs1
    jax.tree.map(np.testing.assert_array_equal, params0, params1)


def _tiny():
    return jax.jit(lambda x, y: jnp.tanh(x) @ y + 1.0)


def test_keys_follow_config_and_argument_shapes(exe_dir):
    x, y = jnp.ones((4, 3)), jnp.ones((3, 2))
    k = jitcache.cache_key("f", {"a": 1}, (x, y))
    assert k == jitcache.cache_key("f", {"a": 1}, (jnp.zeros((4, 3)), y))  # values do not enter
    assert k != jitcache.cache_key("f", {"a": 2}, (x, y))
    assert k != jitcache.cache_key("f", {"a": 1}, (jnp.ones((5, 3)), y))
    assert k != jitcache.cache_key("f", {"a": 1}, (x.astype(jnp.bfloat16), y))
    assert k != jitcache.cache_key("g", {"a": 1}, (x, y))
    assert len(jitcache.source_digest()) == 64


def test_gpu_programs_get_dag_scheduled_command_buffers(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert jitcache.compiler_options() == {}  # this CPU: no options
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    loops = {jitcache.COMMAND_BUFFER_OPTION: jitcache.COMMAND_BUFFER_KINDS}
    # programmatic dependent launch where this XLA has the options (jax 0.10's lacks one)
    pdl = {k: v for k, v in jitcache.PDL_OPTIONS.items()
           if jitcache._xla_accepts(((k, v),), quiet=True)}
    assert "xla_gpu_enable_pdl" in pdl
    assert jitcache.compiler_options() == {jitcache.SCHEDULING_OPTION: "CONCURRENT", **loops,
                                           **pdl}
    # the training program's GEMMs are left unmerged too (likewise optional)
    assert jitcache.compiler_options(training=True) == {
        jitcache.SCHEDULING_OPTION: "CONCURRENT", **loops, **pdl,
        **jitcache.DOT_MERGER_OPTIONS}
    assert "WHILE" in jitcache.COMMAND_BUFFER_KINDS.split(",")
    # the key sees the options: a GPU program compiled without them is another entry
    x = jnp.ones((2, 2))
    k = jitcache.cache_key("f", {}, (x,))
    monkeypatch.setenv("XLA_FLAGS", f"--{jitcache.SCHEDULING_OPTION}=SERIALIZE")
    assert jitcache.compiler_options() == {**loops, **pdl}  # the user's flag decides its option
    assert jitcache.cache_key("f", {}, (x,)) != k
    monkeypatch.setenv("XLA_FLAGS", f"--{jitcache.SCHEDULING_OPTION}=SERIALIZE "
                                    f"--{jitcache.COMMAND_BUFFER_OPTION}=FUSION "
                                    + " ".join(f"--{o}=false" for o in jitcache.PDL_OPTIONS)
                                    + " --xla_gpu_dot_merger_threshold_mb=32")
    assert jitcache.compiler_options() == {} == jitcache.compiler_options(training=True)


def test_an_xla_without_the_option_compiles_without_it(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jitcache, "SCHEDULING_OPTION", "foxhunt_no_such_option")
    with pytest.warns(UserWarning, match="does not take the compile options"):
        # the other option still applies
        assert jitcache.compiler_options() == {
            jitcache.COMMAND_BUFFER_OPTION: jitcache.COMMAND_BUFFER_KINDS,
            **{k: v for k, v in jitcache.PDL_OPTIONS.items()
               if jitcache._xla_accepts(((k, v),), quiet=True)}}


def test_jit_passes_the_options_to_every_compile(monkeypatch):
    # an option this XLA does not know proves the options reach the compiler
    monkeypatch.setattr(jitcache, "compiler_options",
                        lambda training=False: {"foxhunt_no_such_option": 1})
    f = jitcache.jit(lambda x: x * 2)
    with pytest.raises(Exception, match="foxhunt_no_such_option"):
        f.lower(jnp.ones(3)).compile()
    # the training program's options reach its compile too
    monkeypatch.setattr(jitcache, "compiler_options",
                        lambda training=False: {"foxhunt_training_option": 1} if training else {})
    with pytest.raises(Exception, match="foxhunt_training_option"):
        jitcache.jit(lambda x: x * 2, training=True).lower(jnp.ones(3)).compile()
    monkeypatch.setattr(jitcache, "compiler_options", lambda training=False: {})
    np.testing.assert_array_equal(jitcache.jit(lambda x: x * 2)(jnp.ones(3)), 2 * np.ones(3))


def test_only_the_autotuning_cache_rides_with_the_persistent_cache(tmp_path, monkeypatch):
    updates = {}
    monkeypatch.setattr(jax.config, "update", lambda k, v: updates.__setitem__(k, v))
    jitcache.enable_compilation_cache(str(tmp_path), executables=False)
    assert updates["jax_compilation_cache_dir"] == str(tmp_path)
    assert updates["jax_persistent_cache_enable_xla_caches"] == jitcache.XLA_CACHES


def test_a_temporary_cache_takes_the_compiles_and_gives_the_settings_back(tmp_path):
    """compilation_cache_in (the benchmark's fresh cache): compiles inside the block go to its
    folder even after JAX opened another one, and the process's settings come back after it,
    so nothing later writes into a folder that is gone."""
    saved = {n: getattr(jax.config, n) for n in jitcache._JAX_CACHE_SETTINGS}
    saved_exe = jitcache.executable_cache_folder()
    for i in range(2):
        where = tmp_path / f"cache{i}"
        with jitcache.compilation_cache_in(str(where)):
            assert jitcache.executable_cache_folder() == where / "executables"
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
            jax.jit(lambda x, i=i: jnp.cos(x) * (i + 2.5) + x).lower(
                jnp.ones(11 + i)).compile()
        assert [p for p in where.iterdir() if p.is_file()], f"nothing written to {where}"
        assert {n: getattr(jax.config, n) for n in jitcache._JAX_CACHE_SETTINGS} == saved
        assert jitcache.executable_cache_folder() == saved_exe


def _entry_args():
    rng = np.random.default_rng()
    return (jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
            jnp.asarray(rng.normal(size=(3, 2)), jnp.float32))


def test_a_loaded_program_computes_what_a_fresh_compile_does_without_unpickling(
        exe_dir, monkeypatch):
    """Donation, a typed PRNG key and a dict result survive the round trip; the load path
    never unpickles (pickle's loaders fail here)."""
    import pickle

    f = jax.jit(lambda x, y, k: {"z": jnp.tanh(x) @ y + 1.0, "x": x * 2,
                                 "k": jax.random.split(k)}, donate_argnums=0)
    x, y = _entry_args()
    args = (x, y, jax.random.key(7))
    fresh, loaded = jitcache.compile_cached(f, args, name="tiny", config={})
    assert not loaded
    [entry] = list(exe_dir.iterdir())
    assert entry.read_bytes().startswith(b"foxhunt-jax executable")

    def refuse(*a, **k):
        raise AssertionError("the executable cache unpickled something")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    cached, loaded = jitcache.compile_cached(f, args, name="tiny", config={})
    assert loaded
    for _ in range(2):  # fresh inputs, donated each call
        x, y = _entry_args()
        want = fresh(jnp.array(x), y, args[2])
        got = cached(jnp.array(x), y, args[2])
        np.testing.assert_array_equal(got["z"], want["z"])
        np.testing.assert_array_equal(got["x"], want["x"])
        np.testing.assert_array_equal(jax.random.key_data(got["k"]),
                                      jax.random.key_data(want["k"]))
    x = jnp.array(args[0])
    cached(x, args[1], args[2])
    assert x.is_deleted()  # the donation is kept


@pytest.mark.parametrize("damage", ["garbage", "truncated", "flipped"])
def test_a_damaged_entry_is_compiled_again_and_replaced(exe_dir, capfd, damage):
    x, y = _entry_args()
    c, loaded = jitcache.compile_cached(_tiny(), (x, y), name="tiny", config={})
    assert not loaded
    [entry] = list(exe_dir.iterdir())
    blob = entry.read_bytes()
    entry.write_bytes({"garbage": b"not an entry", "truncated": blob[:len(blob) // 2],
                       "flipped": blob[:-10] + bytes([blob[-10] ^ 1]) + blob[-9:]}[damage])
    capfd.readouterr()
    c2, loaded = jitcache.compile_cached(_tiny(), (x, y), name="tiny", config={})
    assert not loaded
    [line] = capfd.readouterr().err.splitlines()
    assert line.startswith("warning: executable cache: could not load") and "BadEntry" in line
    np.testing.assert_array_equal(c(x, y), c2(x, y))
    c3, loaded = jitcache.compile_cached(_tiny(), (x, y), name="tiny", config={})
    assert loaded  # replaced by an intact entry
    np.testing.assert_array_equal(c(x, y), c3(x, y))


def test_an_entry_of_another_key_is_not_loaded(exe_dir, capfd):
    x, y = _entry_args()
    jitcache.compile_cached(_tiny(), (x, y), name="tiny", config={"a": 1})
    [entry] = list(exe_dir.iterdir())
    key = jitcache.cache_key("tiny", {"a": 2}, (x, y))
    entry.rename(jitcache.entry_path("tiny", key))
    c, loaded = jitcache.compile_cached(_tiny(), (x, y), name="tiny", config={"a": 2})
    assert not loaded and "entry of another key" in capfd.readouterr().err
    np.testing.assert_allclose(c(x, y), _tiny()(x, y))


def test_entries_and_folders_others_can_write_are_ignored(exe_dir, capfd, tmp_path):
    x, y = _entry_args()
    want = _tiny()(x, y)
    jitcache.compile_cached(_tiny(), (x, y), name="tiny", config={})
    [entry] = list(exe_dir.iterdir())
    before = entry.read_bytes()
    capfd.readouterr()
    # an entry writable by the group, one owned by another user, a symbolic link
    entry.chmod(0o664)
    c, loaded = jitcache.compile_cached(_tiny(), (x, y), name="tiny", config={})
    assert not loaded and entry.read_bytes() == before  # left alone, not replaced
    np.testing.assert_allclose(c(x, y), want)
    entry.chmod(0o600)
    foreign = os.geteuid() == 0  # only root can give a file away
    if foreign:
        os.chown(entry, 4242, -1)
        c, loaded = jitcache.compile_cached(_tiny(), (x, y), name="tiny", config={})
        assert not loaded and entry.read_bytes() == before
    elsewhere = tmp_path / "elsewhere"
    entry.rename(elsewhere)
    entry.symlink_to(elsewhere)
    c, loaded = jitcache.compile_cached(_tiny(), (x, y), name="tiny", config={})
    assert not loaded
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 2 + foreign and all(
        ln.startswith("warning: executable cache: ignoring") for ln in lines)
    assert "group or others" in lines[0] and "plain file" in lines[-1]
    assert not foreign or "user id 4242" in lines[1]
    # a group-writable folder: one warning for the process, nothing written into it
    entry.unlink()
    exe_dir.chmod(0o775)
    for _ in range(2):
        c, loaded = jitcache.compile_cached(_tiny(), (x, y), name="tiny", config={})
        assert not loaded
        np.testing.assert_allclose(c(x, y), want)
    [line] = capfd.readouterr().err.splitlines()
    assert line.startswith("warning: compilation cache") and "group or others" in line
    assert not list(exe_dir.iterdir())


def test_a_cache_folder_others_can_write_is_not_used(tmp_path, capfd, monkeypatch):
    updates = {}
    monkeypatch.setattr(jax.config, "update", lambda k, v: updates.__setitem__(k, v))
    jitcache.set_executable_cache(tmp_path / "was_on")  # the autouse fixture puts it back
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    assert jitcache.enable_compilation_cache(str(shared)) is None
    assert updates == {} and jitcache.executable_cache_folder() is None  # nor JAX at it
    [line] = capfd.readouterr().err.splitlines()
    assert line.startswith("warning: compilation cache") and str(shared) in line
    # an open folder holding an entry others can write (JAX reads its entries unchecked)
    open_folder = tmp_path / "open"
    open_folder.mkdir(mode=0o755)
    (open_folder / "jit_f-cache").write_bytes(b"x")
    (open_folder / "jit_f-cache").chmod(0o666)
    assert jitcache.enable_compilation_cache(str(open_folder)) is None
    # a path that is a file
    (tmp_path / "a_file").write_text("mine")
    assert jitcache.enable_compilation_cache(str(tmp_path / "a_file")) is None
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 2 and "jit_f-cache" in lines[0] and "cannot create" in lines[1]
    assert updates == {} and (tmp_path / "a_file").read_text() == "mine"
    fresh = tmp_path / "fresh" / "cache"
    assert jitcache.enable_compilation_cache(str(fresh)) == str(fresh)
    assert fresh.stat().st_mode & 0o777 == 0o700  # created private
    assert updates["jax_compilation_cache_dir"] == str(fresh)


PLANTED = textwrap.dedent('''
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from foxhunt_jax import jitcache
    jitcache.enable_compilation_cache(sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # JAX stores it too
    x = jnp.arange(12.0).reshape(4, 3)
    f = jax.jit(lambda x: (jnp.tanh(x) @ x.T + 1.0, x.sum()))
    c, loaded = jitcache.compile_cached(f, (x,), name="tiny", config={})
    key = jitcache.cache_key("tiny", {}, (x,))
    a, b = c(x)
    print(json.dumps({"loaded": loaded, "a": np.asarray(a).tolist(), "b": float(b),
                      "entry": str(jitcache.entry_path("tiny", key))}))
''')


class _Planted:
    """Unpickling this runs ``touch MARKER``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_pickle_runs_nothing_and_the_program_still_computes(tmp_path):
    """Every file in the cache folder (JAX's entries too) and every name the executable cache
    reads, old format included, replaced by a pickle that would create a marker file."""
    import pickle

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cache, marker = tmp_path / "cache", tmp_path / "MARKER"

    def run():
        r = subprocess.run([sys.executable, "-c", PLANTED, str(cache)], capture_output=True,
                           text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr

    first, _ = run()
    entry = Path(first["entry"])
    assert entry.exists()
    payload = pickle.dumps(_Planted(marker))
    pickle.loads(payload)  # the payload works: it creates the marker
    assert marker.exists()
    marker.unlink()
    for f in [*cache.rglob("*"), entry.with_suffix(".pkl")]:
        if not f.is_dir():
            f.write_bytes(payload)
    second, err = run()
    assert not marker.exists()
    assert not second["loaded"] and "could not load" in err
    assert (second["a"], second["b"]) == (first["a"], first["b"])


def test_programs_served_by_the_xla_cache_are_stored_with_its_bytes(tmp_path):
    """After a code change the programs JAX's cache still holds are served by it: the executable
    cache stores each with the bytes JAX's cache held, and the next fresh process loads it
    (no tracing) and computes what XLA's own compile does. Processes: JAX's cache alone, then
    both caches (served, stored), then both again (loaded)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cache = tmp_path / "cache"

    def run(**extra):
        r = subprocess.run([sys.executable, "-c", PLANTED, str(cache)], capture_output=True,
                           text=True, timeout=300, env=dict(env, **extra))
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    xla_only = run(FOXHUNT_JAX_EXECUTABLE_CACHE="off")
    assert any(cache.glob("jit_*")) and not (cache / "executables").exists()
    served = run()
    assert not served["loaded"] and Path(served["entry"]).exists()
    loaded = run()
    assert loaded["loaded"]
    assert (loaded["a"], loaded["b"]) == (xla_only["a"], xla_only["b"])


def test_programs_served_without_their_bytes_are_not_stored(exe_dir):
    class Served:  # a compile JAX's persistent cache answered, its bytes not seen
        def __init__(self, fn):
            self.fn = fn

        def lower(self, *args):
            jax.monitoring.record_event(jitcache._HIT)
            return self.fn.lower(*args)

    x, y = jnp.ones((4, 3)), jnp.ones((3, 2))
    for _ in range(2):
        c, loaded = jitcache.compile_cached(Served(_tiny()), (x, y), name="tiny", config={})
        assert not loaded
    assert not exe_dir.exists() or not list(exe_dir.iterdir())
    np.testing.assert_allclose(c(x, y), _tiny()(x, y))


def test_programs_jax_reuses_in_process_are_not_stored(exe_dir):
    """A second compile of the same jitted program is JAX's in-process executable, which may be
    one its persistent cache served (no cache event marks it then): only the first is kept."""
    x, y = jnp.ones((4, 3)), jnp.ones((3, 2))
    program = _tiny()
    first, _ = jitcache.compile_cached(program, (x, y), name="first", config={})
    again, loaded = jitcache.compile_cached(program, (x, y), name="again", config={})
    assert not loaded
    stored = sorted(p.name for p in exe_dir.rglob("*") if p.is_file())
    assert any("first" in name for name in stored), stored
    assert not any("again" in name for name in stored), stored
    np.testing.assert_allclose(again(x, y), first(x, y))


def test_least_recently_used_entries_are_evicted(tmp_path):
    import os
    import time

    sfx = jitcache.ENTRY_SUFFIX
    for i, name in enumerate(("a", "b", "c")):
        f = tmp_path / f"{name}{sfx}"
        f.write_bytes(b"x" * 100)
        os.utime(f, (time.time() - 100 + i, time.time() - 100 + i))  # a oldest, c newest
    os.utime(tmp_path / f"a{sfx}")  # a was just loaded
    gone = jitcache.evict(tmp_path, 200)
    assert [f.name for f in gone] == [f"b{sfx}"]
    assert sorted(f.name for f in tmp_path.iterdir()) == [f"a{sfx}", f"c{sfx}"]
    assert jitcache.evict(tmp_path, 200) == []


def test_eviction_skips_entries_another_process_removed_meanwhile(tmp_path, monkeypatch):
    """Processes share the cache folder: an entry listed and then deleted by another one's
    eviction is skipped, not an error that keeps a fresh program from being saved."""
    import pathlib
    import time

    sfx = jitcache.ENTRY_SUFFIX
    for i, name in enumerate(("a", "b")):
        f = tmp_path / f"{name}{sfx}"
        f.write_bytes(b"x" * 100)
        os.utime(f, (time.time() - 100 + i, time.time() - 100 + i))  # a older
    listed = pathlib.Path.glob

    def glob_then_gone(self, pattern):  # "ghost" was listed, then removed by another process
        found = list(listed(self, pattern))
        return found + ([self / f"ghost{sfx}"] if pattern.endswith(sfx) else [])

    monkeypatch.setattr(pathlib.Path, "glob", glob_then_gone)
    assert jitcache.evict(tmp_path, 150) == [tmp_path / f"a{sfx}"]
    assert sorted(f.name for f in tmp_path.iterdir()) == [f"b{sfx}"]


def test_cache_off_writes_nothing(tmp_path):
    jitcache.set_executable_cache(None)  # the autouse fixture puts it back
    c, loaded = jitcache.compile_cached(_tiny(), (jnp.ones((2, 3)), jnp.ones((3, 1))),
                                        name="tiny", config={})
    assert not loaded and not list(tmp_path.iterdir())


SHARDED = textwrap.dedent('''
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from foxhunt_jax import jitcache
    jitcache.enable_compilation_cache(sys.argv[1])
    devs = jax.devices()
    mesh = Mesh(np.array([devs[3], devs[0], devs[2], devs[1]]), ("data",))  # not in id order
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("data")))
    f = jax.jit(lambda x: (jnp.sin(x) * 2, jnp.sum(x ** 2)),
                out_shardings=(NamedSharding(mesh, P("data")), NamedSharding(mesh, P())))
    c, loaded = jitcache.compile_cached(f, (x,), name="sharded", config={})
    a, b = c(x)
    print(json.dumps({"loaded": loaded, "a": np.asarray(a).tolist(), "b": float(b),
                      "devices": [d.id for d in a.sharding.mesh.devices.flat]}))
''')


def test_a_sharded_program_loads_onto_its_own_device_order(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", SHARDED, str(tmp_path / "cache")],
                           capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        out.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert [o["loaded"] for o in out] == [False, True]
    assert out[0]["a"] == out[1]["a"] and out[0]["b"] == out[1]["b"]
    assert out[1]["devices"] == [3, 0, 2, 1]


def test_both_backends_share_the_training_program_and_its_key():
    """The executable cache keys the training program without ``network.backend``
    (``pipeline.program_key_config``): that is sound only while both backends lower it to the
    same program."""
    from foxhunt_jax.training.pipeline import program_key_config

    texts, keys = {}, {}
    for backend in ("xla", "pallas"):
        cfg = load_config("smoke", ["network.dtype=bfloat16", f"network.backend={backend}"])
        tr = Trainer.build(cfg)
        state = tr.init_state()
        programs = tr.phase_programs(state)
        jitted, args = programs["training"]
        texts[backend] = jitted.lower(*args).as_text()
        keys[backend] = {name: jitcache.cache_key(name, program_key_config(cfg, name), a)
                         for name, (_, a) in programs.items()}
    assert texts["xla"] == texts["pallas"]
    assert keys["xla"]["training"] == keys["pallas"]["training"]
    assert keys["xla"]["experience"] != keys["pallas"]["experience"]
    assert keys["xla"]["validation"] != keys["pallas"]["validation"]


def _threads_in_reverse(order, count, work):
    """Runs ``work(i, order.turn(i))`` in ``count`` threads started last index first, each
    later index sooner, and returns once all are done (a turn that never came would hang)."""
    import threading
    import time

    def run(i):
        time.sleep(0.05 * (count - 1 - i))  # the last index reaches its turn first
        work(i, order.turn(i))

    threads = [threading.Thread(target=run, args=(i,)) for i in reversed(range(count))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)


@pytest.mark.parametrize("cache", [False, True])
def test_threads_lower_their_programs_in_the_order_given(exe_dir, cache):
    """A compile's threads lower in their LoweringOrder whatever order they reach it in, so the
    program listed first (the longest compile) starts compiling first; a program the
    executable cache serves, or whose tracing fails, hands its turn on."""
    if not cache:
        jitcache.set_executable_cache(None)  # the fixture puts it back
    lowered, results = [], {}
    x = jnp.arange(3.0)

    def work(i, turn):
        def make():
            lowered.append(i)
            if i == 1:
                raise ValueError("this program does not trace")
            return jax.jit(lambda v: v * (i + 1))
        try:
            results[i] = jitcache.compile_cached(make, (x,), name=f"ordered{i}", config={},
                                                 turn=turn)
        except ValueError:
            results[i] = None

    order = jitcache.LoweringOrder()
    _threads_in_reverse(order, 4, work)
    assert lowered == [0, 1, 2, 3]
    assert results[1] is None
    for i in (0, 2, 3):
        compiled, loaded = results[i]
        assert not loaded
        np.testing.assert_array_equal(np.asarray(compiled(x)), np.asarray(x) * (i + 1))
    if cache:  # again: every program but the failing one comes from the cache
        lowered.clear()
        _threads_in_reverse(jitcache.LoweringOrder(), 4, work)
        assert lowered == [1]
        assert all(results[i][1] for i in (0, 2, 3))


@pytest.mark.parametrize("threads", [False, True])
def test_compile_programs_lowers_in_the_dict_s_order_and_keys_results_by_name(threads):
    """compile_programs: each program compiled through compile_cached under its name, lowered
    in the dict's order, the results keyed by name."""
    jitcache.set_executable_cache(None)  # the autouse fixture puts it back
    lowered, x = [], jnp.arange(3.0)

    def make(i):
        def fn():
            lowered.append(i)
            return jax.jit(lambda v: v * (i + 1))
        return fn

    built = jitcache.compile_programs({f"p{i}": (make(i), (x,), {}) for i in range(4)},
                                      threads=threads)
    assert lowered == [0, 1, 2, 3] and list(built) == ["p0", "p1", "p2", "p3"]
    for i, (compiled, loaded) in enumerate(built.values()):
        assert not loaded
        np.testing.assert_array_equal(np.asarray(compiled(x)), np.asarray(x) * (i + 1))

"""The backend value (foxhunt_jax.backend) and the tuning table it carries
(pallas_kernels.tuning): resolved once from the config and the device's properties.

Devices are stand-ins with the attributes a ``jax.Device`` has (``platform``, ``core_count``),
so the GPU rows run on the CPU. That the two backends compute the same numbers is tested entry
point by entry point in test_pallas.py, test_pallas_rnd.py and test_rollout_kernel.py; here the
learner's loss on each backend against its definition.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax import backend as backends
from foxhunt_jax.agent.learner import init_agent, make_learner, per_sample_loss
from foxhunt_jax.config import load_config
from foxhunt_jax.errors import ConfigError
from pallas_kernels import tuning

GPU = SimpleNamespace(platform="gpu", core_count=132, device_kind="NVIDIA H200")
CPU = SimpleNamespace(platform="cpu")


@pytest.mark.parametrize("device, dtype, name, want", [
    (CPU, "bfloat16", "auto", "xla"), (GPU, "bfloat16", "auto", "pallas"),
    (GPU, "float32", "auto", "xla"), (CPU, "bfloat16", "pallas", "pallas"),
    (GPU, "bfloat16", "xla", "xla")])
def test_auto_picks_the_kernels_only_where_they_compile_and_win(device, dtype, name, want):
    cfg = load_config(None, [f"network.dtype={dtype}", f"network.backend={name}"])
    backend = backends.resolve(cfg.network, device)
    assert backend.name == want
    assert backend.tuning == tuning.for_device(device)
    assert (backend.rollout is not None) == (want == "pallas")


def test_a_gymnax_env_runs_xla_and_refuses_pallas():
    """The Pallas kernels are the trading env's: auto resolves to xla for any other env, also
    where they would run for trading, and an explicit pallas is a config error."""
    cfg = load_config(None, ["network.dtype=bfloat16"])
    assert backends.resolve(cfg.network, GPU, "CartPole-v1").name == "xla"
    assert backends.resolve(cfg.network, GPU).name == "pallas"
    pallas = load_config(None, ["network.dtype=bfloat16", "network.backend=pallas"])
    with pytest.raises(ConfigError, match="network.backend.*trading env's kernels only"):
        backends.resolve(pallas.network, GPU, "CartPole-v1")


def test_the_same_inputs_give_the_same_hashable_value():
    cfg = load_config(None)
    a, b = backends.resolve(cfg.network, CPU), backends.resolve(cfg.network, CPU)
    assert a is b and hash(a) == hash(b)  # usable as a static argument of jit
    assert backends.resolve(cfg.network) is backends.make("xla", tuning.for_device())
    with pytest.raises(ConfigError, match="network.backend"):
        backends.make("cuda", tuning.for_device(CPU))


def test_the_tuning_follows_the_device():
    """A CUDA device compiles the kernels and aims their grids at its own multiprocessor count;
    elsewhere the kernels are interpreted with the same launch shapes."""
    cpu, h200 = tuning.for_device(CPU), tuning.for_device(GPU)
    small = tuning.for_device(SimpleNamespace(platform="gpu", core_count=33))
    assert not cpu.compiled and h200.compiled and small.compiled
    assert (cpu.programs, h200.programs, small.programs) == (tuning.DEFAULT_PROGRAMS, 132, 33)
    assert tuning.for_device(SimpleNamespace(platform="gpu")).programs == tuning.DEFAULT_PROGRAMS
    assert cpu.replay.count_max == 0 < h200.replay.count_max
    assert cpu.replay.whole_blocks_max == h200.replay.whole_blocks_max
    for dtype in ("float32", "bfloat16"):
        for table in (cpu, h200, small):
            assert table.q_forward_config(dtype).programs == table.programs
            assert table.rollout_config(dtype).programs == table.programs
        # same shapes but the grid target
        assert dataclasses.replace(cpu.q_forward_config(dtype), programs=132) == \
            h200.q_forward_config(dtype)
    # fewer multiprocessors: a small launch fills them with larger blocks
    n = 4096
    rows = [tuning.block_rows_for(n, t.q_forward_config("bfloat16")) for t in (h200, small)]
    assert rows[0] < rows[1] <= h200.q_forward_config("bfloat16").block_rows


def test_copies_run_as_one_share_the_multiprocessors():
    """A launch run for P copies at once under vmap (a population's members) aims for
    programs / P programs, so each copy's rows go in full-size blocks: the seed's 1024
    episodes take 16-row blocks alone (64 programs) and 128-row blocks as one of 64 members.
    The copies share the rows a per-transition pass holds at once likewise."""
    alone = tuning.for_device(GPU)
    assert tuning.for_device(GPU, copies=1) == alone
    assert alone.row_chunk == tuning.ROW_CHUNK == tuning.for_device().row_chunk
    for copies, programs, rows, row_chunk in ((8, 16, 64, 1 << 17), (64, 2, 128, 1 << 14),
                                              (1000, 1, 128, 1048)):
        shared = tuning.for_device(GPU, copies=copies)
        assert shared.programs == programs and shared.compiled
        assert tuning.block_rows_for(1024, shared.rollout_config("bfloat16")) == rows
        assert shared.row_chunk == row_chunk
        # only the grid target and the row chunk differ
        assert dataclasses.replace(shared, programs=132, q_forward=alone.q_forward,
                                   rollout=alone.rollout, rnd=alone.rnd,
                                   row_chunk=alone.row_chunk) == alone
    assert tuning.for_device(GPU, copies=4096).row_chunk == tuning.MIN_ROW_CHUNK
    assert tuning.block_rows_for(1024, alone.rollout_config("bfloat16")) == 16
    cfg = load_config(None, ["network.dtype=bfloat16"])
    assert backends.resolve(cfg.network, GPU, copies=64).tuning == tuning.for_device(GPU, 64)


def test_a_device_that_reports_its_memory_gives_its_passes_more_rows(monkeypatch):
    """The copies of a launch share ``ROW_CHUNK`` rows a pass where the device reports no
    memory (the CPU), and as many as half its memory holds at ``ROW_BYTES`` a row where that is
    more, each copy at most ``ROW_CHUNK`` (a single agent's). On a GPU with 100 GiB usable, a
    population of 64 seed-sized members (102,400 transitions each) runs its passes whole. A
    multi-process run keeps ``ROW_CHUNK`` (its processes must compile the same programs)."""
    def gpu(limit):
        return SimpleNamespace(platform="gpu", core_count=132,
                               memory_stats=lambda: None if limit is None else
                               {"bytes_limit": limit, "bytes_in_use": 0})

    big = 100 * 2**30
    expect = int(big * tuning.PASS_MEMORY_FRACTION) // tuning.ROW_BYTES
    assert tuning.pass_rows(gpu(big)) == expect > tuning.ROW_CHUNK
    assert tuning.for_device(gpu(big)).row_chunk == tuning.ROW_CHUNK  # one copy: a single agent's
    assert tuning.for_device(gpu(big), copies=8).row_chunk == tuning.ROW_CHUNK
    assert tuning.for_device(gpu(big), copies=64).row_chunk == expect // 64 >= 102_400
    for small in (None, 0, 2**30):  # no figure, or less than ROW_CHUNK rows
        assert tuning.pass_rows(gpu(small)) == tuning.ROW_CHUNK
    assert tuning.pass_rows(GPU) == tuning.pass_rows(CPU) == tuning.ROW_CHUNK
    assert tuning.for_device().row_chunk == tuning.ROW_CHUNK  # this CPU reports none
    # only the row chunk depends on the memory
    assert dataclasses.replace(tuning.for_device(gpu(big), copies=64),
                               row_chunk=tuning.ROW_CHUNK // 64) == tuning.for_device(GPU, 64)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert tuning.pass_rows(gpu(big)) == tuning.ROW_CHUNK
    assert tuning.for_device(gpu(big), copies=64).row_chunk == tuning.ROW_CHUNK // 64


def test_block_rows_stay_powers_of_two_within_bounds():
    cfg = tuning.for_device(GPU).q_forward_config("bfloat16")
    for n in (1, 15, 16, 17, 132 * 16, 132 * 16 + 1, 1 << 20):
        bm = tuning.block_rows_for(n, cfg)
        assert bm & (bm - 1) == 0 and max(cfg.min_rows, 16) <= bm <= cfg.block_rows


def test_the_learners_loss_is_the_same_on_both_backends():
    """per_sample_loss with each backend's forwards and bootstrap loss equals the definition
    (the Flax network and the jnp loss), on a small float32 network in interpret mode."""
    cfg = load_config("smoke", ["network.trunk=[32]", "network.head=16", "network.atoms=5",
                                "curiosity.coef=0"])
    learner = make_learner(cfg, (3, 2))
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    agent = init_agent(jax.random.key(int(rng.integers(1 << 30))), learner, 9)
    target = jax.tree.map(lambda x: x + 0.05 * jnp.asarray(rng.standard_normal(x.shape),
                                                            jnp.float32), agent.params)
    m = 20
    obs, next_obs = (jnp.asarray(rng.standard_normal((m, 9)), jnp.float32) for _ in range(2))
    action = jnp.asarray(np.stack([rng.integers(0, 3, m), rng.integers(0, 2, m)], 1), jnp.int32)
    returns = jnp.asarray(rng.standard_normal(m), jnp.float32)
    discount = jnp.asarray(0.99 * (rng.random(m) > 0.2), jnp.float32)
    args = (agent.params, target, obs, next_obs, action, returns, discount)
    want = per_sample_loss(learner, *args)
    for name in backends.NAMES:
        got = per_sample_loss(learner, *args, backend=backends.make(name, tuning.for_device()))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_dtype_auto_resolves_per_device_once_per_run():
    cfg = load_config("smoke")
    assert cfg.network.dtype == "auto"
    on_gpu, on_cpu = backends.resolve_config(cfg, GPU), backends.resolve_config(cfg, CPU)
    assert on_gpu.network.dtype == "bfloat16" and on_cpu.network.dtype == "float32"
    # the fast path on a GPU: bf16 and the kernels; XLA in float32 on a CPU
    assert backends.resolve(cfg.network, GPU).name == "pallas"
    assert backends.resolve(on_gpu.network, GPU).name == "pallas"
    assert backends.resolve(on_cpu.network, CPU).name == "xla"
    # a concrete dtype is kept; pallas asked for off a GPU is refused rather than run in f32
    f32 = load_config("smoke", ["network.dtype=float32"])
    assert backends.resolve_config(f32, GPU) is f32
    assert backends.resolve(f32.network, GPU).name == "xla"
    with pytest.raises(ConfigError, match="network.backend"):
        backends.resolve_config(load_config("smoke", ["network.backend=pallas"]), CPU)
    with pytest.raises(ConfigError, match="network.backend"):
        load_config("smoke", ["network.backend=pallas", "network.dtype=float32"])


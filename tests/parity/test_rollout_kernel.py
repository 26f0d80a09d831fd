"""The fused rollout kernel (pallas_kernels/rollout.py) against the lax.scan it replaces.

Collection (epsilon-greedy, auto-reset) and greedy evaluation (per-episode lengths, ruin) run
once through the scan of jnp functions (the ``xla`` backend) and once through the kernel in
Pallas' interpret mode (the ``pallas`` backend), from the same keys: actions, bars and flags
must be equal, money and observations equal to float32 rounding. A last test lowers both
kernel modes for a CUDA GPU on this CPU, which runs the whole Pallas-to-Triton lowering (every
primitive the kernel uses must have a Triton rule) without a GPU.
"""

import dataclasses
import re
from types import SimpleNamespace

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from foxhunt_jax import backend as backends
from foxhunt_jax.agent.learner import init_agent, make_learner
from foxhunt_jax.config import load_config
from foxhunt_jax.data.features import build_tables
from foxhunt_jax.data.loader import load_market
from foxhunt_jax.env import trading
from foxhunt_jax.training import collect, validate
from foxhunt_jax.training.trainer import TRADING_ADAPTER
from pallas_kernels import q_forward as qf
from pallas_kernels import tuning
from pallas_kernels import rollout as rollout_kernel
from pallas_kernels.rollout import fused_rollout, launch_spans

# float32 GEMMs: in bfloat16 the kernel and XLA sum each product in a different order, and a
# last-bit difference that flips the bf16 rounding of one activation can flip a near-tied greedy
# action (then the paths part). In float32 both compute the same values to ~1e-7, so the
# trajectories must be equal; bfloat16 equality is checked on the GPU by the bench
# (rollout_equality).
SMALL = ["network.trunk=[32]", "network.head=16", "network.atoms=5", "curiosity.hidden=8",
         "curiosity.embed=4"]
# the config only offers pallas with bfloat16 (speed); the kernel itself takes float32
BACKENDS = {name: backends.make(name, tuning.for_device()) for name in backends.NAMES}


@pytest.fixture(scope="module")
def tables():
    return build_tables(load_market(["builtin:us_stocks_daily"]), episode_length=100)


def _setup(tables, backend, overrides=(), split="train"):
    cfg = load_config("smoke", SMALL + ["network.backend=xla"] + list(overrides))
    params = trading.make_params(tables, cfg.env, split)
    return cfg, params, make_learner(cfg, cfg.env.branch_sizes)


def _agent(learner, params, seed):
    agent = init_agent(jax.random.key(seed), learner, trading.obs_dim(params))
    # larger output weights than at init, so greedy actions differ between rows and steps
    p = jax.tree.map(lambda x: x * 3.0, agent.params)
    return agent.replace(params=p)


def _agreement(got_action, ref_action) -> np.ndarray:
    """[N] episodes whose every action agrees."""
    return np.all(np.asarray(got_action) == np.asarray(ref_action), axis=(0, 2))


def _agreeing(got_action, ref_action) -> np.ndarray:
    """:func:`_agreement`, at least 3/4 of the episodes. Rarely, a greedy near-tie is broken
    differently by the two (their GEMMs sum in different orders) and that episode's path parts
    from there on; a fault in the kernel would part most episodes."""
    same = _agreement(got_action, ref_action)
    assert same.mean() >= 0.75, f"only {same.mean():.0%} of the episodes agree"
    return same


def _agreeing_draw(run, action=lambda t: t["action"], tries: int = 3):
    """``run(seed) -> (got, ref)`` on fresh seeds until 3/4 of the episodes agree in their
    ``action(got)`` and ``action(ref)`` (:func:`_agreeing`), at most ``tries`` draws; returns
    ``(got, ref, same)``. A random agent whose expected Q sit near ``v_max`` can tie many
    actions to float rounding (see ``test_validation_loss_backends_agree``), and then most
    episodes part (a 28 % agreement was seen once; 150 other draws agreed on 17 or 18 of 18
    episodes); a fault in the kernel parts most episodes on every draw."""
    seen = []
    for _ in range(tries):
        seed = int(np.random.default_rng().integers(1 << 30))
        got, ref = run(seed)
        same = _agreement(action(got), action(ref))
        if same.mean() >= 0.75:
            return got, ref, same
        seen.append((seed, f"{same.mean():.0%}"))
    raise AssertionError(f"too few episodes agree on every draw (seed, agreement): {seen}")


def _assert_same_trajectory(got, ref):
    same = _agreeing(got["action"], ref["action"])
    pick = lambda x: np.asarray(x)[:, same]  # noqa: E731
    for k in ("terminated", "truncated"):
        np.testing.assert_array_equal(pick(got[k]), pick(ref[k]), err_msg=k)
    for k in ("obs", "next_obs"):
        np.testing.assert_array_equal(pick(got[k]["bar"]), pick(ref[k]["bar"]), err_msg=k)
        np.testing.assert_allclose(pick(got[k]["portfolio"]), pick(ref[k]["portfolio"]),
                                   rtol=2e-5, atol=2e-6, err_msg=k)
    np.testing.assert_allclose(pick(got["reward"]), pick(ref["reward"]), rtol=2e-5, atol=2e-7)
    return same


@pytest.mark.parametrize("overrides, n, eps", [
    ([], 24, 0.3),  # 3 branches; 24 rows pad to two blocks of 16; fills at the next open
    (["env.take_profit=[]", "env.stop_loss=[]", "env.cost_bps=10", "env.fill=close"], 16,
     0.0),  # one branch
    (["env.stop_loss=[]", "env.time_barrier=2", "env.ruin_floor=0.97", "env.fill=close",
      "env.slippage_bps=5"], 20, 0.5),
])
def test_fused_collection_equals_scan(tables, overrides, n, eps):
    steps, over = 12, ["env.episode_length=5"] + overrides  # several resets per episode

    def run(seed):
        key, out = jax.random.key(seed), {}
        for backend in ("xla", "pallas"):
            _, params, learner = _setup(tables, backend, over)
            agent = _agent(learner, params, seed)
            rollout = collect.start(TRADING_ADAPTER, params, jax.random.fold_in(key, 1), n)
            # the fresh agent is an argument, not a constant: the program hits the compile cache
            out[backend] = jax.jit(lambda a, r, k, _l=learner, _p=params, _b=BACKENDS[backend]:
                                   collect.trajectory(_l, _b, TRADING_ADAPTER, _p, a, r, k,
                                                      jnp.float32(eps), steps))(agent.params,
                                                                                rollout, key)
        return out["pallas"], out["xla"]

    (r_pal, t_pal), (r_xla, t_xla), _ = _agreeing_draw(run, action=lambda o: o[1]["action"])
    branches = len(_setup(tables, "xla", over)[0].env.branch_sizes)
    chex.assert_shape(t_pal["action"], (steps, n, branches))
    chex.assert_type(t_pal["action"], jnp.int32)
    chex.assert_shape(t_pal["next_obs"]["portfolio"], (steps, n, trading.PORTFOLIO_DIM))
    same = _assert_same_trajectory(t_pal, t_xla)
    assert int(jnp.sum(t_xla["truncated"])) >= n  # the auto-reset path was taken
    chex.assert_trees_all_close(jax.tree.map(lambda x: x[same], r_pal),
                                jax.tree.map(lambda x: x[same], r_xla), rtol=2e-5, atol=2e-6)


def test_loop_form_is_chosen_by_episode_count(tables):
    """Up to ``tuning.rollout_max_episodes`` the Pallas backend runs the rollout kernel; above
    it, the scan with the fused Q-forward per step, which gives the same trajectory."""
    _, params, learner = _setup(tables, "pallas", ["env.episode_length=5"])
    pallas, xla = BACKENDS["pallas"], BACKENDS["xla"]
    limit = pallas.tuning.rollout_max_episodes
    assert pallas.runs_rollout_kernel(limit)
    assert not pallas.runs_rollout_kernel(limit + 1)
    assert not xla.runs_rollout_kernel(16)
    pallas = backends.make("pallas", dataclasses.replace(pallas.tuning, rollout_max_episodes=16))
    kernel_calls = []
    real = TRADING_ADAPTER.fused
    adapter = dataclasses.replace(TRADING_ADAPTER, fused=lambda *a: kernel_calls.append(1)
                                  or real(*a))
    seed = int(np.random.default_rng().integers(1 << 30))
    key = jax.random.key(seed)
    agent = _agent(learner, params, seed)
    out = {}
    for n in (16, 24):
        rollout = collect.start(TRADING_ADAPTER, params, jax.random.fold_in(key, 1), n)
        for name, be in (("pallas", pallas), ("xla", xla)):
            out[name, n] = jax.jit(lambda a, r, k, _b=be: collect.trajectory(
                learner, _b, adapter, params, a, r, k, jnp.float32(0.3), 8))(
                    agent.params, rollout, key)[1]
    assert len(kernel_calls) == 1  # traced once: N = 16 (the kernel); N = 24 took the scan
    for n in (16, 24):
        _assert_same_trajectory(out["pallas", n], out["xla", n])


def test_fused_collection_feeds_the_whole_experience_phase(tables):
    """collect() with the kernel: same replay items, priorities and curiosity statistics."""
    steps, n = 6, 16
    key = jax.random.key(5)  # fixed: a near-tie here would change a whole row of items
    res = {}
    for backend in ("xla", "pallas"):
        _, params, learner = _setup(tables, backend, ["env.episode_length=4"])
        agent = _agent(learner, params, 3)
        rollout = collect.start(TRADING_ADAPTER, params, key, n)
        res[backend] = jax.jit(lambda r, k, _l=learner, _p=params, _a=agent, _b=BACKENDS[backend]:
                               collect.collect(_l, _b, TRADING_ADAPTER, _p, _a, r, k,
                                               jnp.float32(0.2), steps))(rollout, key)
    _, items, prio, rnd, stats = res["pallas"]
    _, items_x, prio_x, rnd_x, stats_x = res["xla"]
    chex.assert_trees_all_close(items, items_x, rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close((prio, rnd, stats), (prio_x, rnd_x, stats_x), rtol=1e-4,
                                atol=1e-5)


@pytest.mark.parametrize("overrides", [
    ["env.slippage_bps=2"], ["env.ruin_floor=0.985", "env.cost_bps=20", "env.fill=close"]])
def test_fused_evaluation_equals_scan(tables, overrides):
    steps = 10

    def run(seed):
        rng, got = np.random.default_rng(seed), {}
        for backend in ("xla", "pallas"):
            _, params, learner = _setup(tables, backend, overrides, split="validation")
            agent = _agent(learner, params, seed)
            starts = jnp.asarray(validate.window_starts(np.asarray(params.starts), 18))
            lengths = jnp.asarray(rng.integers(1, steps + 1, size=starts.shape[0]), jnp.int32) \
                if backend == "xla" else got["lengths"]
            got["lengths"] = lengths
            got[backend] = jax.jit(lambda p, s, le, _l=learner, _e=params, _b=BACKENDS[backend]:
                                   validate.greedy_rollout(_l, _b, p, _e, s, steps,
                                                           jax.random.key(0), le))(
                                       agent.params, starts, lengths)
        return got["pallas"], got["xla"]

    out, ref, same = _agreeing_draw(run)
    assert set(out) == set(ref)
    pick = lambda x: np.asarray(x)[:, same]  # noqa: E731
    for k in ("bar", "next_bar", "terminated", "truncated", "traded", "fills", "alive"):
        np.testing.assert_array_equal(pick(out[k]), pick(ref[k]), err_msg=k)
    for k in ("portfolio", "next_portfolio", "reward", "equity", "exposure", "turnover"):
        np.testing.assert_allclose(pick(out[k]), pick(ref[k]), rtol=2e-5, atol=2e-6, err_msg=k)
    assert not bool(jnp.all(ref["alive"]))  # some windows ended early (length or ruin)


def _kernel_inputs(tables, n: int, steps: int, overrides=()):
    """A fresh random agent on the smoke config and a collection's inputs for ``n`` episodes
    and ``steps`` steps: ``(params, learner, agent, state, resets, draws)``, the draws
    exploring about three quarters of the branches (-1 greedy)."""
    _, params, learner = _setup(tables, "pallas", overrides)
    agent = _agent(learner, params, int(np.random.default_rng().integers(1 << 30)))
    _, state = jax.vmap(trading.reset_at, in_axes=(0, None))(params.starts[:n], params)
    resets = jnp.broadcast_to(params.starts[n:2 * n], (steps, n))
    draws = jax.random.randint(jax.random.key(3), (steps, n, 3), -1, 3)
    return params, learner, agent, state, resets, draws


def test_reading_weight_blocks_ahead_leaves_the_rollout_unchanged(tables):
    """``KernelConfig.lookahead`` (two blocks ahead by default in bfloat16) only
    moves the weight loads earlier: both modes give bit-equal results with 16-wide blocks."""
    n, steps = 20, 6
    params, learner, agent, state, resets, draws = _kernel_inputs(tables, n, steps)
    net, z = learner.network, learner.support
    runs = []
    for ahead in (0, 2):
        kc = qf.KernelConfig(block_rows=16, num_warps=4, max_chunk=16, lookahead=ahead)
        runs.append(jax.jit(lambda p, s, _c=kc: (
            fused_rollout(p, net, z, params, s, steps, draws=draws, reset_bars=resets,
                          config=_c),
            fused_rollout(p, net, z, params, s, steps, mode="evaluate", config=_c)))(
                agent.params, state))
    chex.assert_trees_all_equal(runs[1], runs[0])


def _assert_same_rollout(got, ref):
    """Two ``fused_rollout`` results of one input: the episodes whose every action (and greedy
    action) agrees, at least 3/4 of them (:func:`_agreeing`; interpreted on this CPU, XLA may
    round the two programs' products differently and flip a near-tied greedy action), have
    equal bars, flags and actions, and money, logits and end states equal to float32 rounding."""
    (out, end), (out_ref, end_ref) = got, ref
    same = _agreeing(out["action"], out_ref["action"])
    if "greedy" in out:
        same &= _agreement(out["greedy"], out_ref["greedy"])
    for name, x in out.items():
        for y, y_ref in zip(jax.tree.leaves(x), jax.tree.leaves(out_ref[name])):
            y, y_ref = np.asarray(y)[:, same], np.asarray(y_ref)[:, same]
            if np.issubdtype(y.dtype, np.floating):
                np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-6, err_msg=name)
            else:
                np.testing.assert_array_equal(y, y_ref, err_msg=name)
    for y, y_ref in zip(jax.tree.leaves(end), jax.tree.leaves(end_ref)):
        np.testing.assert_allclose(np.asarray(y)[same], np.asarray(y_ref)[same], rtol=2e-5,
                                   atol=2e-6)


def test_a_step_in_two_halves_leaves_the_rollout_unchanged(tables, monkeypatch):
    """The whole-window kernel runs each step as two loop iterations (the forward, then the env
    step; ``HALVES_MAX_ROWS``, for a shorter compile) or as one: both modes give the same
    rollouts, across resets and frozen episodes (on the H200 bit for bit, docs/performance.md)."""
    n, steps = 20, 6
    params, learner, agent, state, resets, draws = _kernel_inputs(tables, n, steps,
                                                                  ["env.episode_length=4"])
    net, z = learner.network, learner.support
    kc = qf.KernelConfig(block_rows=16, num_warps=4, max_chunk=16)
    lengths = jnp.asarray(np.random.default_rng().integers(1, steps + 1, n), jnp.int32)
    runs = []
    for max_rows in (16, 0):
        monkeypatch.setattr(rollout_kernel, "HALVES_MAX_ROWS", max_rows)
        runs.append(jax.jit(lambda p, s: (
            fused_rollout(p, net, z, params, s, steps, draws=draws, reset_bars=resets,
                          config=kc),
            fused_rollout(p, net, z, params, s, steps, mode="evaluate", lengths=lengths,
                          config=kc)))(agent.params, state))
    for mode in range(2):
        _assert_same_rollout(runs[0][mode], runs[1][mode])
    collected, evaluated = runs[0]
    assert bool(jnp.any(collected[0]["truncated"][1:]))  # episodes restarted inside the window
    assert not bool(jnp.all(evaluated[0]["alive"]))  # and some evaluation episodes froze


def test_stepped_collection_equals_the_whole_window_kernel(tables, monkeypatch):
    """``fused_rollout(stepped=True)`` (one launch a timestep under a scan, the state and the
    outputs through memory) gives the whole-window kernel's collection bit for bit, across
    resets, with the window's loop running a step as one iteration as the stepped launch does
    (its two-iteration form: :func:`test_a_step_in_two_halves_leaves_the_rollout_unchanged`);
    the tuning picks it where a launch's blocks fill its multiprocessors ``STEPPED_WAVES``
    times over, and only for collection."""
    monkeypatch.setattr(rollout_kernel, "HALVES_MAX_ROWS", 0)
    n, steps = 20, 4  # two blocks of 16 rows; every episode restarts after its third step
    params, learner, agent, state, resets, draws = _kernel_inputs(tables, n, steps,
                                                                  ["env.episode_length=3"])
    net, z = learner.network, learner.support
    kc = qf.KernelConfig(block_rows=16, num_warps=4, max_chunk=16)
    whole, stepped = (jax.jit(lambda p, s, _st=st: fused_rollout(
        p, net, z, params, s, steps, draws=draws, reset_bars=resets, config=kc,
        stepped=_st))(agent.params, state) for st in (False, True))
    chex.assert_trees_all_equal(stepped, whole)
    assert bool(jnp.any(whole[0]["truncated"][1:]))  # episodes restarted inside the window
    with pytest.raises(ValueError, match="collect mode"):
        fused_rollout(agent.params, net, z, params, state, steps, mode="evaluate", stepped=True)
    h200 = SimpleNamespace(platform="gpu", core_count=132)
    population = tuning.for_device(h200, copies=64)  # 8 blocks of 128 rows for 2 programs
    single = tuning.for_device(h200)
    assert population.rollout_stepped(1024, "bfloat16")
    assert tuning.for_device(h200, copies=32).rollout_stepped(1024, "bfloat16")  # 8 for 4
    assert not tuning.for_device(h200, copies=16).rollout_stepped(1024, "bfloat16")  # 8 for 8
    assert not single.rollout_stepped(1024, "bfloat16")  # 64 blocks of 16 for 132 programs
    assert single.rollout_stepped(1 << 20, "bfloat16")


def _validation_losses(tables, seed: int) -> dict:
    """The validation loss of one random agent on the xla backend's greedy trajectory, with
    each backend's forwards and with the pallas kernels but the Flax forward for the greedy
    actions at s' (:func:`collect.greedy_after`)."""
    flax_greedy = dataclasses.replace(BACKENDS["pallas"], q_forward=BACKENDS["xla"].q_forward)
    loss = {}
    for backend, be in (("xla", BACKENDS["xla"]), ("pallas", BACKENDS["pallas"]),
                        ("pallas, Flax greedy at s'", flax_greedy)):
        _, params, learner = _setup(tables, backend.split(",")[0], split="validation")
        agent = _agent(learner, params, seed)
        starts = jnp.asarray(validate.window_starts(np.asarray(params.starts), 12))
        traj = jax.jit(lambda p, s, _l=learner, _e=params, _b=be: validate.greedy_rollout(
            _l, _b, p, _e, s, 6, jax.random.key(0)))(agent.params, starts)
        if backend == "xla":
            ref_traj = traj  # every loss on one trajectory, so only the forwards differ
        loss[backend] = jax.jit(lambda a, t, _l=learner, _e=params, _b=be:
                                validate.validation_loss(_l, _b, a.params, a.target_params, _e,
                                                         t))(agent, ref_traj)
    return loss


def test_validation_loss_backends_agree(tables):
    """The validation loss runs its forwards through the fused kernels (interpret mode here)
    under the Pallas backend: the same loss as the Flax forwards. Where this agent's
    expected Q sit near v_max, two actions' values can tie to ~1e-6, and the two backends
    (summing in different orders) may break such a tie at s' differently and bootstrap from
    another action; so the losses are equal to 1e-5 given the same greedy actions at s' on every
    draw, and to 2e-3 with each backend's own on one of at most three fresh draws (one draw in
    a fresh clone's CI differed by 5.6e-3 over its 72 samples; one of 30 fixed seeds broke a tie
    at all; a fault in the kernels moves the loss on every draw)."""
    seen = []
    for _ in range(3):
        seed = int(np.random.default_rng().integers(1 << 30))
        loss = _validation_losses(tables, seed)
        chex.assert_shape(loss["pallas"], ())
        assert float(loss["xla"]) > 0.0
        np.testing.assert_allclose(float(loss["pallas, Flax greedy at s'"]), float(loss["xla"]),
                                   rtol=1e-5, err_msg=f"seed {seed}")
        gap = abs(float(loss["pallas"]) - float(loss["xla"])) / float(loss["xla"])
        if gap <= 2e-3:
            return
        seen.append((seed, f"{gap:.1e}"))
    raise AssertionError(f"the backends' own greedy actions part on every draw: {seen}")


def test_rollout_arguments_are_checked(tables):
    _, params, learner = _setup(tables, "pallas")
    agent = _agent(learner, params, 0)
    _, state = jax.vmap(trading.reset_at, in_axes=(0, None))(params.starts[:16], params)
    with pytest.raises(ValueError, match="mode must be one of"):
        fused_rollout(agent.params, learner.network, learner.support, params, state, 3, mode="x")
    with pytest.raises(ValueError, match="reset_bars are required in collect mode"):
        fused_rollout(agent.params, learner.network, learner.support, params, state, 3)


def _for_cuda(tables, n: int, steps: int) -> SimpleNamespace:
    """What lowering the kernel for a CUDA GPU on this CPU takes: an H200's tuning, the default
    bf16 network of the smoke config, ``n`` episodes' start state, greedy draws and reset bars
    for ``steps`` steps."""
    cfg = load_config("smoke", ["network.dtype=bfloat16", "network.backend=pallas"])
    params = trading.make_params(tables, cfg.env, "train")
    learner = make_learner(cfg, cfg.env.branch_sizes)
    _, state = jax.vmap(trading.reset_at, in_axes=(0, None))(params.starts[:n], params)
    return SimpleNamespace(
        gpu=tuning.for_device(SimpleNamespace(platform="gpu", core_count=132)), params=params,
        learner=learner, agent=init_agent(jax.random.key(0), learner, trading.obs_dim(params)),
        state=state, draws=jnp.full((steps, n, 3), -1, jnp.int32),
        resets=jnp.broadcast_to(params.starts[:n], (steps, n)))


def test_kernel_lowers_for_cuda_on_this_cpu(tables):
    """Pallas -> Triton lowering of both modes at the default network width (no GPU needed),
    with a CUDA device's launch shapes."""
    steps = 4
    c = _for_cuda(tables, 256, steps)
    gpu, params, agent, state, draws, resets = c.gpu, c.params, c.agent, c.state, c.draws, c.resets
    net, z = c.learner.network, c.learner.support
    default = gpu.rollout_config(net.dtype)
    collect_fn = jax.jit(lambda p, s, d, r: fused_rollout(p, net, z, params, s, steps, draws=d,
                                                          reset_bars=r, config=default,
                                                          interpret=False))
    text = collect_fn.trace(agent.params, state, draws, resets).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text and "fused_rollout" in text
    # evaluation also with weight blocks read ahead (the Q-forward's default reading), and at
    # 32-row blocks, whose loop runs a step as one iteration (HALVES_MAX_ROWS)
    wide = qf.KernelConfig(block_rows=32, min_rows=32, num_warps=8, max_chunk=128)
    assert 32 > rollout_kernel.HALVES_MAX_ROWS
    assert "xla.gpu.triton" in jax.jit(lambda p, s, d, r: fused_rollout(
        p, net, z, params, s, steps, draws=d, reset_bars=r, config=wide, interpret=False)).trace(
            agent.params, state, draws, resets).lower(lowering_platforms=("cuda",)).as_text()
    for kc in (default, qf.KernelConfig(block_rows=16, num_warps=8, max_chunk=128, lookahead=2),
               wide):
        eval_fn = jax.jit(lambda p, s, _c=kc: fused_rollout(
            p, net, z, params, s, steps, mode="evaluate", config=_c, interpret=False))
        assert "xla.gpu.triton" in eval_fn.trace(agent.params, state).lower(
            lowering_platforms=("cuda",)).as_text()


def _triton_calls(lowered_text: str) -> list[str]:
    """The backend configs of a lowered program's Triton kernel calls: their kernel text, grid
    and launch shape, what XLA compiles each distinct one of once in a program."""
    return re.findall(r'custom_call @__gpu\$xla\.gpu\.triton\(.*?\) \{(.*?)\} :', lowered_text,
                      re.S)


def test_a_window_s_launches_are_one_kernel(tables):
    """The launches of a collection window (:func:`launch_spans`), whole or one a timestep
    (stepped), lower to one Triton kernel text for a CUDA GPU on this CPU: the step count and
    the step axis of the per-step arrays are not in it, so XLA compiles the rollout kernel once
    per program instead of once per launch length."""
    steps = 12
    c = _for_cuda(tables, 256, steps)
    net, z, config = c.learner.network, c.learner.support, c.gpu.rollout_config("bfloat16")
    spans = launch_spans(steps)
    assert [b - a for a, b in spans] == [9, 3]
    for stepped in (False, True):
        def window(p, s, d, r, _stepped=stepped):
            outs = []
            for a, b in spans:
                out, s = fused_rollout(p, net, z, c.params, s, b - a, draws=d[a:b],
                                       reset_bars=r[a:b], config=config, interpret=False,
                                       stepped=_stepped)
                outs.append(out)
            return outs, s
        lowered = jax.jit(window).trace(c.agent.params, c.state, c.draws, c.resets).lower(
            lowering_platforms=("cuda",))
        calls = _triton_calls(lowered.as_text())
        assert len(calls) == 2 and calls[0] == calls[1], stepped


def test_rollout_spans_cover_the_window_in_order():
    """The collection kernel's launches (collect.rollout_spans with a rollout kernel):
    contiguous, from 0 to L, the last a quarter of the steps (rounded down); one launch under 4
    steps. A scan (no kernel: the xla backend, more episodes than the kernel takes, or an env
    without one) is one span."""
    pallas, xla = BACKENDS["pallas"], BACKENDS["xla"]
    no_kernel = dataclasses.replace(TRADING_ADAPTER, fused=None)
    too_many = pallas.tuning.rollout_max_episodes + 1
    for steps in (1, 3, 4, 6, 12, 100, 101):
        spans = collect.rollout_spans(pallas, TRADING_ADAPTER, 16, steps)
        assert spans == launch_spans(steps)
        for be, adapter, n in ((xla, TRADING_ADAPTER, 16), (pallas, no_kernel, 16),
                               (pallas, TRADING_ADAPTER, too_many)):
            assert collect.rollout_spans(be, adapter, n, steps) == ((0, steps),)
        assert spans[0][0] == 0 and spans[-1][1] == steps
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert all(start < stop for start, stop in spans)
        assert len(spans) == (1 if steps < 4 else 2)
        if len(spans) == 2:
            assert spans[1][1] - spans[1][0] == steps // 4

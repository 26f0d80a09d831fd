"""Launch shapes and size thresholds of the kernels, by the device that runs them.

This is the one place that reads the device: :func:`for_device` turns a ``jax.Device``'s
properties (its platform and, on a GPU, its multiprocessor count ``core_count``) into a
:class:`Tuning`. The numbers were measured on Hopper GPUs (H100/H200, 228 KB of shared memory a
multiprocessor); docs/performance.md keeps the measurements. Any other CUDA GPU gets the same
shapes with its own multiprocessor count; a platform without CUDA runs the kernels in Pallas'
interpret mode (for checking on the CPU, not for speed) with the same shapes, so an interpreted
kernel computes exactly what the compiled one does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax

# The grid size a launch aims for when the device does not report its multiprocessors (the CPU,
# interpret mode): an H100/H200 has 132.
DEFAULT_PROGRAMS = 132
# Widest power-of-two block of one GEMM operand, per dtype: a [128, 256] x [256, 256] bfloat16
# tile pair fits a Hopper multiprocessor's shared memory; float32 operands are twice the bytes.
MAX_CHUNK = {"bfloat16": 256, "float32": 128}
# The rows a per-transition pass (initial priorities, novelty) evaluates at once, as it holds
# [rows, width] float32 activations a layer (1 GiB at 2^20 rows of 256): at most ROW_CHUNK for
# one copy of a launch, and the copies together at most the device's pass_rows (ROW_CHUNK, or
# what PASS_MEMORY_FRACTION of a device's reported memory holds at ROW_BYTES of temporaries a
# row, what a population's Experience program holds compiled for the CPU); at least
# MIN_ROW_CHUNK a copy.
ROW_CHUNK = 1 << 20
MIN_ROW_CHUNK = 1 << 10
ROW_BYTES = 4096
PASS_MEMORY_FRACTION = 0.5


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape: rows per program (powers of two >= 16: ``block_rows`` at large N, down to
    ``min_rows`` at small N so that the grid keeps about ``programs`` programs), warps per
    program (``block_rows / 8`` clipped to ``[min_warps, num_warps]``), software-pipelining
    stages, layout, the widest GEMM operand block (``max_chunk``; None: :data:`MAX_CHUNK` of the
    dtype) and how many parameter blocks each program reads ahead of use (``lookahead``)."""

    block_rows: int = 128
    num_warps: int = 8
    num_stages: int = 1
    layout: str = "grouped"
    min_rows: int = 16
    min_warps: int = 4
    max_chunk: int | None = None
    lookahead: int = 0
    programs: int = DEFAULT_PROGRAMS


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def block_rows_for(n: int, cfg: KernelConfig) -> int:
    """Rows per program for ``n`` rows: ``cfg.block_rows``, smaller when ``n`` is small so that
    the grid still has about ``cfg.programs`` programs (one per multiprocessor), never under
    ``cfg.min_rows`` or 16 (the smallest tensor-core dot)."""
    want = next_pow2(max(1, -(-n // cfg.programs)))
    return int(min(cfg.block_rows, max(cfg.min_rows, 16, want)))


@dataclass(frozen=True)
class ReplaySearch:
    """How the replay buffer's two-level slot search runs; it finds the same slots either way.

    Attributes:
      count_max: the most ``[M, k]`` pairs the block search compares at once (one kernel,
        where a binary search launches ~log2(k) dependent ones: pays on a GPU); 0 where work,
        not launches, counts (the CPU).
      whole_blocks_max: the largest ``M x S`` gather of whole blocks for the slot inside a
        block; above it a block is searched in sub-blocks, which reads far less at large M.
    """

    count_max: int = 0
    whole_blocks_max: int = 1 << 18


@dataclass(frozen=True)
class Tuning:
    """Everything device-dependent about how the kernels (and the replay's search) launch.

    Attributes:
      compiled: the kernels compile with Triton (a CUDA GPU); else they run interpreted.
      programs: the grid size small launches aim for: the device's multiprocessors, shared
        among the copies of a launch that run as one (:func:`for_device`).
      q_forward: ``(dtype, KernelConfig)`` pairs of the fused Q-forward (:meth:`q_forward_config`).
      rollout: ``(dtype, KernelConfig)`` pairs of the rollout kernel (:meth:`rollout_config`).
      rnd: the curiosity kernel's launch shape.
      rollout_max_episodes: the most parallel episodes a rollout runs as one kernel; above it
        the scan of per-step kernels is the faster form (one program then holds too many
        episodes' state for the multiprocessors to stay occupied).
      replay: the replay buffer's search shape (:class:`ReplaySearch`).
      row_chunk: the most rows of one copy that a per-transition pass evaluates at once
        (the device's :func:`pass_rows` shared among the copies, at most :data:`ROW_CHUNK`;
        :func:`for_device`).
    """

    compiled: bool
    programs: int
    q_forward: tuple[tuple[str, KernelConfig], ...]
    rollout: tuple[tuple[str, KernelConfig], ...]
    rnd: KernelConfig
    rollout_max_episodes: int
    replay: ReplaySearch
    row_chunk: int

    def q_forward_config(self, dtype: str) -> KernelConfig:
        return dict(self.q_forward)[dtype]

    def rollout_config(self, dtype: str) -> KernelConfig:
        return dict(self.rollout)[dtype]

    def rollout_stepped(self, num_episodes: int, dtype: str) -> bool:
        """Whether a collection rollout of ``num_episodes`` (one copy of the launch) runs one
        launch a timestep: where its blocks number at least :data:`STEPPED_WAVES` times
        ``programs``."""
        blocks = -(-num_episodes // block_rows_for(num_episodes, self.rollout_config(dtype)))
        return blocks >= STEPPED_WAVES * self.programs


# The Q-forward: bfloat16 at 128 rows and 8 warps (fewer warps wait on tensor-core tiles; 2 warps
# spill), weight blocks of 128 columns read two ahead; float32 operands are twice the bytes, so
# half the rows. The rollout kernel runs the same forward each timestep and takes the same
# shapes: reading ahead pays where its blocks are full (a population's 128-row blocks) and costs
# nothing at a single agent's 16. The curiosity kernel takes the bfloat16 Q-forward's rows and
# warps.
_Q_FORWARD = {"float32": KernelConfig(block_rows=64, num_warps=8, max_chunk=MAX_CHUNK["float32"]),
              "bfloat16": KernelConfig(block_rows=128, num_warps=8, min_warps=8, max_chunk=128,
                                       lookahead=2)}
_RND = KernelConfig(block_rows=128, num_warps=8)
ROLLOUT_MAX_EPISODES = 1 << 15
# A collection rollout whose blocks fill the multiprocessors (a launch's share of them) at least
# this many times over launches once a timestep (:func:`pallas_kernels.rollout.fused_rollout`'s
# ``stepped``), because there the per-step launches collect faster than the one launch of the
# whole window; a single agent's blocks fit in one wave and keep the one launch. The
# populations measured either way are in docs/performance.md.
STEPPED_WAVES = 2
_REPLAY_GPU = ReplaySearch(count_max=1 << 24)


def _table(compiled: bool, programs: int, row_chunk: int) -> Tuning:
    shaped = lambda table: tuple((dtype, dataclasses.replace(cfg, programs=programs))  # noqa: E731
                                 for dtype, cfg in table.items())
    return Tuning(compiled=compiled, programs=programs, q_forward=shaped(_Q_FORWARD),
                  rollout=shaped(_Q_FORWARD), rnd=dataclasses.replace(_RND, programs=programs),
                  rollout_max_episodes=ROLLOUT_MAX_EPISODES,
                  replay=_REPLAY_GPU if compiled else ReplaySearch(), row_chunk=row_chunk)


def is_cuda(device) -> bool:
    """Whether ``device`` is a CUDA GPU (where the kernels compile with Triton)."""
    return getattr(device, "platform", None) in ("gpu", "cuda")


def pass_rows(device) -> int:
    """The rows the per-transition passes of all copies of a launch may evaluate at once on
    ``device``: :data:`ROW_CHUNK`, or more in a one-process run where the device reports its
    memory (``memory_stats()["bytes_limit"]``, a GPU) and :data:`PASS_MEMORY_FRACTION` of it
    holds more rows at :data:`ROW_BYTES` each. The processes of a multi-process run keep
    :data:`ROW_CHUNK`: they must compile the same programs, and they cannot read each other's
    devices."""
    if jax.process_count() > 1:
        return ROW_CHUNK
    stats = getattr(device, "memory_stats", None)
    limit = (stats() or {}).get("bytes_limit", 0) if callable(stats) else 0
    return max(ROW_CHUNK, int(limit * PASS_MEMORY_FRACTION) // ROW_BYTES)


def for_device(device=None, copies: int = 1) -> Tuning:
    """The :class:`Tuning` of ``device`` (default: JAX's first device). Read from the device:
    its platform (compiled on a CUDA GPU, interpreted elsewhere) and its multiprocessor count
    (``core_count``; :data:`DEFAULT_PROGRAMS` where it reports none).

    ``copies``: how many instances of each launch run as one (``jax.vmap`` of a kernel adds a
    grid axis of that size, e.g. a population's members on this device). The multiprocessors
    are shared among them: a launch aims for ``programs / copies`` programs (at least one), so
    the rows of all copies fill the device with full-size blocks instead of each copy cutting
    its rows into blocks for the whole device. The device's memory is shared likewise: each
    copy's per-transition passes take ``pass_rows(device) / copies`` rows at a time, at most
    :data:`ROW_CHUNK` (a single agent's).
    """
    if device is None:
        device = jax.devices()[0]
    cores = getattr(device, "core_count", None) if is_cuda(device) else None
    programs = int(cores) if cores else DEFAULT_PROGRAMS
    copies = max(1, int(copies))
    return _table(is_cuda(device), max(1, programs // copies),
                  max(MIN_ROW_CHUNK, min(ROW_CHUNK, pass_rows(device) // copies)))


__all__ = ["KernelConfig", "ReplaySearch", "Tuning", "for_device", "is_cuda", "block_rows_for",
           "next_pow2", "pass_rows", "DEFAULT_PROGRAMS", "MAX_CHUNK", "ROLLOUT_MAX_EPISODES",
           "STEPPED_WAVES",
           "ROW_CHUNK"]

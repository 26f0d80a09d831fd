"""Random replay transitions for the learner tests (a helper module, not a test file)."""

import numpy as np


def random_transitions(rng: np.random.Generator, n: int, dim: int, branch_sizes) -> dict:
    """``n`` transitions with ``[n, dim]`` observations, one action per branch, rewards and
    discounts in [0, 1): the item layout the learner reads (float32, actions int32)."""
    return {"obs": rng.normal(size=(n, dim)).astype(np.float32),
            "next_obs": rng.normal(size=(n, dim)).astype(np.float32),
            "action": np.stack([rng.integers(0, b, n) for b in branch_sizes], 1).astype(np.int32),
            "reward": rng.normal(size=n).astype(np.float32),
            "discount": rng.uniform(0, 1, n).astype(np.float32)}

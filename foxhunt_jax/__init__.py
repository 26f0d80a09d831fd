"""foxhunt-jax: a distributional, branching, dueling Double-DQN trading agent trained on device."""

__version__ = "0.1.0"

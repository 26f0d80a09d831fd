"""foxhunt-jax: a distributional, branching, dueling Double-DQN trading agent trained on device.

Library entry points (imported lazily so that ``foxhunt-jax data check`` starts without JAX):
``load_config``, ``train``, ``evaluate``, ``load_market``.
"""

from foxhunt_jax.version import __version__

_LAZY = {
    "load_config": ("foxhunt_jax.config", "load_config"),
    "Config": ("foxhunt_jax.config", "Config"),
    "train": ("foxhunt_jax.api", "train"),
    "evaluate": ("foxhunt_jax.api", "evaluate"),
    "load_run": ("foxhunt_jax.api", "load_run"),
    "load_market": ("foxhunt_jax.data.loader", "load_market"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'foxhunt_jax' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]

"""``python -m foxhunt_jax.bench ...``: the same as ``foxhunt-jax bench ...`` (the compile and
cmdbuf sections start their fresh processes this way)."""

from foxhunt_jax.bench.runner import main

main()

"""``python -m foxhunt_jax ...`` runs the command line (:func:`foxhunt_jax.cli.main`)."""

from foxhunt_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

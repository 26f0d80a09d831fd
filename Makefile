# Two commands: `make train` (the main job on the embedded default data) and `make test`.
# Each creates or updates the virtual environment in .venv by itself.
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: train test check clean-venv

$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e ".[test]"
	@touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/foxhunt-jax train --config configs/default.yaml --out runs/default $(ARGS)

# worksteal: an idle worker takes queued tests from the busy one, so the long tests do not pile
# up at the end of one worker (2026-11-30, this repository's 2-core CPU machine, one clone, back
# to back: `pytest -q -n 2 --dist worksteal` 9:13 min, xdist's default 9:37)
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 --dist worksteal $(ARGS)

clean-venv:
	rm -rf $(VENV)

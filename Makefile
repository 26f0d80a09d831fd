# Two commands: `make train` (the main job on the embedded default data) and `make test`.
# Each creates or updates the virtual environment in .venv by itself.
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: train test check clean-venv

$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip "setuptools>=77"
	# the build backend (pyproject's build-system) is already in the environment: no isolated
	# build environment to create for the editable install; the installed modules are byte-compiled
	# after it on every core (pip compiles them on one), the packages' own test folders left out
	# (nothing imports them; a third of the files)
	$(VENV)/bin/python -m pip install --quiet --no-build-isolation --no-compile -e ".[test]"
	$(VENV)/bin/python -m compileall -q -j 0 -x '/tests?/' $$($(VENV)/bin/python -c "import sysconfig; print(sysconfig.get_path('purelib'))") > /dev/null
	@touch $(STAMP)

# the repository's own modules byte-compiled first (under 1 s): with PYTHONDONTWRITEBYTECODE set,
# as on the development and CI machines, every process would compile them again (0.6 s each)
BYTECODE = $(VENV)/bin/python -m compileall -q -j 0 foxhunt_jax pallas_kernels tests > /dev/null

train: $(STAMP)
	$(BYTECODE)
	$(VENV)/bin/foxhunt-jax train --config configs/default.yaml --out runs/default $(ARGS)

# loadfile: a test file runs in one worker, so its tests share that process's compiled programs
# and module fixtures (2-core CPU, warm compile cache, back to back: loadfile 5:33 min,
# worksteal 6:48)
test: $(STAMP)
	$(BYTECODE)
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile $(ARGS)

clean-venv:
	rm -rf $(VENV)

# Every target sets itself up on a fresh machine: `make test` and `make demo` are enough.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.damcha-installed
# pytest-xdist workers; the suite is sized for this 2-core machine.
WORKERS ?= 2

.PHONY: install test demo bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The pinned CPU build; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[all,models,dev]"
	touch $(STAMP)

install: $(STAMP)

test: install
	DAMCHA_REQUIRE_ALL_BACKENDS=1 $(PY) -m pytest -n $(WORKERS) --durations=15 tests

demo: install
	$(VENV)/bin/damcha conform

bench: install
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info

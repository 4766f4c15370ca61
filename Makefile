# Every target sets itself up on a fresh machine: `make test` and `make demo` are enough.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.damcha-installed
# pytest-xdist workers; the suite is sized for this 2-core machine. worksteal (xdist >= 3.2):
# a worker that runs out of tests takes the tail half of the other's queue, where `--dist load`
# leaves tests queued behind a long one on a busy worker while the other idles; with the long
# modules first (tests/conftest.py, RUN_FIRST) the last tests on each worker are short.
WORKERS ?= 2

.PHONY: install js-deps lint test demo bench clean

$(STAMP): pyproject.toml setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned: on this project's machines 2.13.0 resolves to a CPU build they hold; an unpinned torch (or plain PyPI elsewhere) pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[all,models,dev]"
	# keras-hub (damcha_keras.convert) without its declared dependencies: its tensorflow-text
	# needs the full tensorflow package, which clashes with tensorflow-cpu; what keras_hub
	# imports comes with the extras above (docs/models.md, "Installing keras-hub").
	$(PY) -m pip install -q --no-deps -c constraints.txt keras-hub
	touch $(STAMP) $(KERNEL_STAMP)

# The C kernel (setup.py, backends/torch/_headmix.c) is built by the editable install above;
# rebuilt in place when its source changes in a checkout whose venv is already made.
KERNEL_STAMP := $(VENV)/.damcha-kernel
$(KERNEL_STAMP): $(STAMP) setup.py backends/torch/_headmix.c
	$(PY) -m pip install -q --no-deps --no-build-isolation -c constraints.txt -e .
	touch $@

install: $(STAMP) $(KERNEL_STAMP)

# onnxruntime-node/-web for the JavaScript checks (tests/test_onnx_js.py): pinned in
# js/package.json + lockfile. --ignore-scripts: the CPU binaries ship in the npm
# packages; onnxruntime-node's install script would only fetch CUDA ones.
JS_STAMP := js/node_modules/.package-lock.json
$(JS_STAMP): js/package.json js/package-lock.json
	cd js && npm ci --ignore-scripts --no-audit --no-fund

js-deps: $(JS_STAMP)

# mypy reads the packages through build/typing/, one link per import name (damcha_onnx ->
# onnx_export/, ...): it cannot learn those names from the editable install's import hook.
# Made here, never committed (build/ is ignored). Pairs: import name:folder.
TYPING   := build/typing
PACKAGES := damcha_core:damcha_core damcha_conformance:conformance damcha_experiments:experiments \
            damcha_onnx:onnx_export damcha_torch:backends/torch damcha_jax:backends/jax damcha_keras:backends/keras
TYPING_STAMP := $(TYPING)/.links

$(TYPING_STAMP): Makefile
	mkdir -p $(TYPING)
	$(foreach p,$(PACKAGES),ln -sfn ../../$(word 2,$(subst :, ,$(p))) $(TYPING)/$(word 1,$(subst :, ,$(p))) &&) true
	touch $@

# Lint and format (ruff, everything) and types (mypy, [tool.mypy] in pyproject.toml: the core
# strict, the other packages, the three ports included, with the default checks).
lint: install $(TYPING_STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy $(foreach p,$(PACKAGES),-p $(word 1,$(subst :, ,$(p))))

test: install js-deps lint
	DAMCHA_REQUIRE_ALL_BACKENDS=1 $(PY) -m pytest -n $(WORKERS) --dist worksteal --durations=15 tests

demo: install
	$(VENV)/bin/damcha conform

bench: install js-deps
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info js/node_modules backends/torch/_headmix*.so backends/torch/_headmix*.pyd

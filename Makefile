# Two entry points for a new user (see README.md):
#   make demo   set up .venv-$(BACKEND) (the wheel with one framework) and run the main job
#               (interrupt, resume, compare)
#   make test   for each backend, a fresh .venv-<backend> with that framework alone (from the
#               wheel): quick start, CLI, demo and its test suite; then, in .venv (every
#               framework), the tests that need several
#   make lab    open the example notebooks in JupyterLab (BACKEND=jax|tensorflow|torch)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BACKENDS := tensorflow jax torch
BACKEND ?= jax
# Test processes per backend (pytest-xdist; whole files per process, so a module fixture
# such as the cross-backend matrix runs once). CI has 2 cores; 3 processes keep them busy while
# a test waits on a child process, a lock or the object store (TensorFlow suite: 442 s against
# 459 s with 2, 2026-12-05).
JOBS ?= 3
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider -n $(JOBS) --dist loadfile --no-loadscope-reorder --durations=20
comma := ,
space := $(subst ,, )
export TF_CPP_MIN_LOG_LEVEL := 3
# pip's check for a newer pip asks the index on every call: once per install is enough
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# Python keeps the bytecode of what it imports (its default; empty turns off a
# PYTHONDONTWRITEBYTECODE=1 of the caller's environment, as this machine's and CI's have):
# without it every test process and child compiled the checkout's modules, the test tools
# and pytest's rewritten test files again from source (the JAX suite from the wheel: 234 s
# and 450 CPU-s against 294 s and 524, 2026-12-06). The bytecode goes where Python puts it:
# the environments make builds and __pycache__ folders git ignores.
export PYTHONDONTWRITEBYTECODE :=

.PHONY: setup demo test test-% lint docs bench clean fuzz lab matrix

# pip --no-compile: Python compiles a module when it is first imported (and keeps the bytecode,
# see PYTHONDONTWRITEBYTECODE above), not every module of every package at install: the
# frameworks bring 10,000-15,000 modules each, of which a run imports a fraction (JAX's extra
# and the demo's: 8 s and 8 CPU-s against 18 s and 18, 2026-12-06).
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile -c constraints.txt -e ".[all,dev,demo,docs]"
	touch $@

setup: $(VENV)/.installed

# A user's install: a fresh environment with the wheel and one framework's extra (Torch: the
# CPU build constraints.txt pins), nothing else; the wheel is kept beside it. Rebuilt when
# the package, pyproject.toml or constraints.txt change. pip is upgraded first, as in .venv:
# the one a venv starts with (23.2 here) takes three times as long to resolve the same pins
# (the three installs of JAX's environment: 20 s and 19 CPU-s against 36 s and 35, 2026-12-06).
PACKAGE_FILES := $(shell find keras_stable_state -name '*.py' -o -name 'py.typed')
.venv-%/.installed: pyproject.toml constraints.txt README.md $(PACKAGE_FILES)
	rm -rf .venv-$*
	$(PYTHON) -m venv .venv-$*
	.venv-$*/bin/pip install -q --upgrade pip
	.venv-$*/bin/pip wheel -q --no-deps -w .venv-$*/wheel .
	.venv-$*/bin/pip install -q --no-compile -c constraints.txt "$$(ls .venv-$*/wheel/keras_stable_state-*.whl)[$*]"
	touch $@

demo: .venv-$(BACKEND)/.installed
	.venv-$(BACKEND)/bin/pip install -q -c constraints.txt "$$(ls .venv-$(BACKEND)/wheel/keras_stable_state-*.whl)[$(BACKEND),demo]"
	.venv-$(BACKEND)/bin/python examples/resume_demo.py --backend $(BACKEND)

# Each framework alone, as a user installs it (tests/install_check.py): a fresh .venv-<backend>
# from the wheel; in it the README's quick start as written (twice), the command line on its
# files, the demo, then that backend's test suite (TESTS=quick: its quick tier). A step that
# imports another framework fails. Tests that need another framework are skipped there with
# that reason and run in .venv's several-frameworks pass of make test.
TESTS ?= all
.PHONY: test-installs checks
test-alone-%:
	rm -rf .venv-$*
	$(MAKE) --no-print-directory .venv-$*/.installed
	$(PYTHON) tests/install_check.py --backend $* --venv .venv-$* --tests $(TESTS) --jobs $(JOBS)

test-installs: $(addprefix test-alone-,$(BACKENDS))

# ruff everywhere; mypy on the public API (its files and settings: [tool.mypy] in pyproject.toml)
lint: setup
	$(BIN)/ruff check keras_stable_state tests benchmarks examples
	$(BIN)/ruff format --check keras_stable_state tests benchmarks examples
	$(BIN)/mypy

docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d build/site

test-%: setup
	KERAS_BACKEND=$* $(PYTEST) tests

# The quick loop while working: every test not marked slow (pytest -m "not slow"; a slow
# test takes more than about 5 s on a 2-core machine) on all three backends.
.PHONY: test-fast
test-fast: setup
	@for b in $(BACKENDS); do \
		echo "=== backend: $$b (not slow) ==="; \
		KERAS_BACKEND=$$b $(PYTEST) -m "not slow" tests || exit 1; \
	done

# tests/docs/test_docs_api.py reads the site just built (KSS_DOCS_SITE) instead of building one.
# Each backend's suite in the user's install (that framework alone, from the wheel), then, in
# .venv with every framework, only the tests that need another one beside the backend's.
# The preparations are one core's work each (pip, the quick start, the command line, the
# demo): two run at a time (make -j2, each one's output printed when it ends) beside the
# lint and docs (all four at once took 3m56s against 3m12s, 2026-12-06). Then each backend's
# suite with every core (the three at once took 1116 s against 1074 s one after the other:
# they keep the two cores 91-97% busy alone, and more processes only add contention). Then the
# three several-frameworks passes at once (289 s against 336 s one after the other: a pass alone
# waits on its child processes of other backends), PASS_JOBS test processes each: one, since
# every process imports all three frameworks (about 20 CPU-s) and the three passes with their
# child processes keep both cores busy (245 s and 446 CPU-s against 268 s and 508 with two
# each, 258 s with two for JAX alone; 2026-12-06).
prepare-alone-%:
	rm -rf .venv-$*
	$(MAKE) --no-print-directory .venv-$*/.installed
	$(PYTHON) tests/install_check.py --backend $* --venv .venv-$* --tests $(TESTS) --phase prepare

checks: lint docs

# Test processes of each several-frameworks pass (three run at once)
PASS_JOBS ?= 1
several-frameworks-%: setup
	@echo "=== backend: $*, beside the other frameworks: the tests that need several ($$(date +%T)) ==="
	@KSS_TEST_PASS=several-frameworks KSS_DOCS_SITE=build/site KERAS_BACKEND=$* \
		$(subst -n $(JOBS),-n $(PASS_JOBS),$(PYTEST)) tests

test:
	@echo "=== setup, lint, docs and each backend's install from the wheel, two at a time ($$(date +%T)) ==="
	@$(MAKE) --no-print-directory -j2 --output-sync=target TESTS=all checks $(addprefix prepare-alone-,$(BACKENDS))
	@for b in $(BACKENDS); do \
		echo "=== backend: $$b, installed alone from the wheel: its tests ($$(date +%T)) ==="; \
		$(PYTHON) tests/install_check.py --backend $$b --venv .venv-$$b --tests all --jobs $(JOBS) --phase tests || exit 1; \
	done
	@echo "=== each backend beside the other frameworks, at once: the tests that need several ($$(date +%T)) ==="
	@$(MAKE) --no-print-directory -j3 --output-sync=target $(addprefix several-frameworks-,$(BACKENDS))
	@echo "=== done ($$(date +%T)) ==="

# Device placement (issue 17): a restore lands on each variable's device / JAX sharding. On
# a GPU machine the variables live on the GPU; JAX also runs the sharded case on 4
# simulated CPU devices (and the 2-process harness); then the save/restore benchmark.
.PHONY: test-device
test-device: setup
	XLA_FLAGS=--xla_force_host_platform_device_count=4 KERAS_BACKEND=jax $(BIN)/python -m pytest -q -p no:cacheprovider -rs tests/transfer/test_device_placement.py
	KERAS_BACKEND=jax $(BIN)/python -m pytest -q -p no:cacheprovider -rs tests/transfer/test_device_placement.py tests/transfer/test_multiprocess_jax.py
	@for b in tensorflow torch; do KERAS_BACKEND=$$b $(BIN)/python -m pytest -q -p no:cacheprovider -rs tests/transfer/test_device_placement.py || exit 1; done
	@for b in $(BACKENDS); do KERAS_BACKEND=$$b $(BIN)/python benchmarks/save_restore.py --sizes 120 --rounds 3 || exit 1; done

# Long fuzz campaign of damaged files on every backend (tests/integrity/test_integrity.py); override
# the budget with e.g. `make fuzz KSS_FUZZ_FLIPS=5000`; KSS_FUZZ_SEED draws other cases.
KSS_FUZZ_FLIPS ?= 2000
KSS_FUZZ_TRUNCATIONS ?= 100
KSS_FUZZ_EDITS ?= 300
# SIGKILLs at random moments during saves (StableCheckpoint, async saves, fit), and examples
# per hypothesis property test (make test runs 10).
KSS_KILL_SAVES ?= 50
KSS_S3_KILLS ?= 20
KSS_HYPOTHESIS_EXAMPLES ?= 200
# Restores under 20 memory limits from 1.1x to 3x the state, and 1000 saves from another
# thread during fit (tests/hostile/test_hostile_memory.py, tests/hostile/test_hostile_threads.py).
KSS_MEMORY_LIMITS ?= 20
KSS_THREAD_SAVES ?= 1000
# Preempted child fits (a real SIGTERM at a random step, then the resume; make test runs 2).
KSS_PREEMPT_TRIALS ?= 20
fuzz: setup
	@status=0; for b in $(BACKENDS); do \
		echo "=== fuzz campaign, backend: $$b ==="; \
		KSS_FUZZ_FLIPS=$(KSS_FUZZ_FLIPS) KSS_FUZZ_TRUNCATIONS=$(KSS_FUZZ_TRUNCATIONS) \
		KSS_FUZZ_EDITS=$(KSS_FUZZ_EDITS) KSS_FUZZ_INSPECT_EVERY=1 KERAS_BACKEND=$$b \
		$(BIN)/python -m pytest -q -p no:cacheprovider tests/integrity/test_integrity.py || status=1; \
		echo "=== $(KSS_KILL_SAVES) SIGKILLs during saves, backend: $$b ==="; \
		KSS_KILL_SAVES=$(KSS_KILL_SAVES) KERAS_BACKEND=$$b $(BIN)/python -m pytest -q -p no:cacheprovider -rP \
			tests/manager/test_checkpoint_dir.py tests/manager/test_async_save.py -k sigkill_at_random_moments || status=1; \
		echo "=== property tests with $(KSS_HYPOTHESIS_EXAMPLES) examples, backend: $$b ==="; \
		KSS_HYPOTHESIS_EXAMPLES=$(KSS_HYPOTHESIS_EXAMPLES) KERAS_BACKEND=$$b $(BIN)/python -m pytest -q \
			-p no:cacheprovider tests/integrity/test_storage_format.py tests/state/test_bytes.py tests/state/test_mappers.py || status=1; \
		echo "=== $(KSS_MEMORY_LIMITS) memory limits, $(KSS_THREAD_SAVES) saves from another thread, backend: $$b ==="; \
		KSS_MEMORY_LIMITS=$(KSS_MEMORY_LIMITS) KSS_THREAD_SAVES=$(KSS_THREAD_SAVES) KERAS_BACKEND=$$b $(BIN)/python -m pytest \
			-q -p no:cacheprovider tests/hostile/test_hostile_memory.py tests/hostile/test_hostile_threads.py || status=1; \
		echo "=== $(KSS_PREEMPT_TRIALS) SIGTERMs at random steps of fit, backend: $$b ==="; \
		KSS_PREEMPT_TRIALS=$(KSS_PREEMPT_TRIALS) KERAS_BACKEND=$$b $(BIN)/python -m pytest -q -p no:cacheprovider \
			tests/manager/test_preemption.py -k random_steps || status=1; \
		echo "=== full disks, file-size limits and 300,000 extra index rows, backend: $$b ==="; \
		KSS_HOSTILE_DISK_STEPS=16 KSS_HOSTILE_ROWS=300000 KERAS_BACKEND=$$b $(BIN)/python -m pytest -q \
			-p no:cacheprovider tests/hostile/test_hostile_disk.py tests/hostile/test_hostile_messages.py || status=1; \
		echo "=== $(KSS_S3_KILLS) SIGKILLs of a writer into an S3 directory, backend: $$b ==="; \
		KSS_S3_KILLS=$(KSS_S3_KILLS) KERAS_BACKEND=$$b $(BIN)/python -m pytest -q -p no:cacheprovider \
			tests/manager/test_object_store.py -k killed_at_a_random_moment || status=1; \
	done; exit $$status

# Resume-conformance matrix (tests/matrix.py): MATRIX_CASES drawn fit configurations per
# backend and seed of MATRIX_SEED (one or more seeds), each killed and resumed in fresh
# processes and compared with its uninterrupted run, which is compared bit for bit with the
# same fit without the library (invariance); results in MATRIX_OUT, the table of
# docs/how-to/resume-fit.md rewritten from them. Fails on any silent difference, crash or
# invariance failure. make test runs a fixed-seed sample.
MATRIX_SEED ?= 0 1 2
MATRIX_CASES ?= 500
MATRIX_OUT ?= build/matrix-results.json
matrix: setup
	@mkdir -p $(dir $(MATRIX_OUT))
	$(BIN)/python tests/matrix.py --seed $(MATRIX_SEED) --cases $(MATRIX_CASES) \
		--backends $(subst $(space),$(comma),$(BACKENDS)) --jobs $(JOBS) --out $(MATRIX_OUT) --render-docs

# Benchmarks: step overhead, then save/restore, many variables and memory on every backend,
# whose table is written into docs/performance.md (BENCH_ARGS=--full for 12 MB-1 GB states / 100k variables).
BENCH_ARGS ?=
bench: setup
	@for b in $(BACKENDS); do KERAS_BACKEND=$$b $(BIN)/python benchmarks/step_overhead.py || exit 1; done
	$(BIN)/python benchmarks/report.py --backends $(subst $(space),$(comma),$(BACKENDS)) $(BENCH_ARGS)
	@for b in $(BACKENDS); do KERAS_BACKEND=$$b $(BIN)/python benchmarks/async_save.py || exit 1; done

# The notebooks extra (JupyterLab, matplotlib) on top of the dev setup, once per pyproject change.
$(VENV)/.notebooks: $(VENV)/.installed pyproject.toml
	$(BIN)/pip install -q -c constraints.txt -e ".[notebooks]"
	touch $@

lab: $(VENV)/.notebooks
	KERAS_BACKEND=$(BACKEND) $(BIN)/jupyter lab notebooks/

clean:
	rm -rf $(VENV) $(addprefix .venv-,$(BACKENDS)) .pytest_cache

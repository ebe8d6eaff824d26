# The project's commands. `make test` and `make demo` each work as the first command on a
# fresh machine: they create .venv when it is missing and install the package into it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# pytest-xdist workers for make test: each takes whole test files (their module-scoped runs
# stay shared); the suite is compile-bound and one process keeps about 1.1 of 2 cores busy.
TEST_WORKERS ?= 2

.PHONY: demo test bench lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Stamp files re-install when pyproject.toml changes.
$(VENV)/.installed-base: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@ $(VENV)/.installed-base

demo: $(VENV)/.installed-base
	$(BIN)/jaxrl-scale demo

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

bench: $(VENV)/.installed-test
	$(BIN)/python benchmarks/bench_model.py
	$(BIN)/python benchmarks/bench_fit.py
	$(BIN)/python benchmarks/bench_losses.py
	$(BIN)/python benchmarks/bench_sampler.py
	$(BIN)/python benchmarks/bench_generation.py
	$(BIN)/python benchmarks/bench_pipeline.py
	$(BIN)/python benchmarks/bench_hosts.py
	$(BIN)/python benchmarks/bench_soak.py
	$(BIN)/python benchmarks/bench_feeder.py
	$(BIN)/python benchmarks/bench_mismatch.py --layers 4
	$(BIN)/python benchmarks/bench_learning.py
	$(BIN)/python benchmarks/bench_sandbox.py
	$(BIN)/python benchmarks/bench_episode_engine.py
	$(BIN)/python benchmarks/bench_demo.py
	$(BIN)/python benchmarks/bench_serve.py
	$(BIN)/python benchmarks/bench_agents.py
	$(BIN)/python benchmarks/bench_agent_learning.py
	$(BIN)/python benchmarks/bench_declines.py
	$(BIN)/python benchmarks/bench_real_curves.py

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/shellcheck launch/*.sh launch/*.sbatch .ci/run

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache

# The README's two commands: `make demo` (the main job) and `make test`. Both set up .venv first.
# TORCH is pinned in the same pip command as the rest (a CPU wheel on these machines); on a machine
# that already has a CUDA torch in the venv, run `make TORCH= demo` to keep it.
PY ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
# test files run in parallel, one whole file per worker (a module's servers and Ray cluster start
# once); `make test TEST_WORKERS=0` runs them in this process, TEST_WORKERS=auto one per core
TEST_WORKERS ?= 2
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export WANDB_MODE ?= offline
export HF_HOME ?= $(CURDIR)/.cache/hf
export WANDB_DIR ?= $(CURDIR)/.cache/wandb

.PHONY: install demo test clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH) -e '.[dev,distributed]'
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/python -m scripts.demo $(ARGS)

test: install
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile $(ARGS)

clean:
	rm -rf $(VENV) .cache .pytest_cache

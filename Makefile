# simsd: set-up, demo and tests on a fresh machine (see README.md).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; on a GPU machine use e.g. TORCH_SPEC="torch==2.14.1".
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.simsd-installed

.PHONY: install demo bench test lint docs clean

$(STAMP): pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q --no-build-isolation -e ".[triton,test,data,serve,ray,docs]"
	touch $(STAMP)

install: $(STAMP)

# The main job: SimSD exact-mode speculative decoding with the bundled tiny draft/target pair
# on a held-out prompt, then the vanilla baseline on the same prompt.
demo: $(STAMP)
	$(BIN)/simsd generate --mode exact --max-tokens 96
	$(BIN)/simsd generate --mode vanilla --max-tokens 96

bench: $(STAMP)
	$(BIN)/simsd bench --limit 8 --max-tokens 96

# The tests run small models: one intra-op thread each unless OMP_NUM_THREADS says otherwise
# (torch's default of every core makes them many times slower on a busy machine; docs/cli.md "CPU threads").
test: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -q tests

# ruff over the whole tree (pyproject.toml: line length, import order, unused names)
lint: $(STAMP)
	$(BIN)/ruff check .

# the documentation site (mkdocs.yml) under site/; --strict: a broken link or anchor, a page left
# out of the nav or an API reference entry that names a missing object fails the build
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) build *.egg-info site

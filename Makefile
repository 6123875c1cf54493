# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv themselves.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp

.PHONY: setup test lint demo bench fuzz soak long clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev,plot,huggingface,lightning,torchtitan]'
	touch $(STAMP)

# The project's bytecode is compiled first: every daemon and rank process the suite starts then loads it instead
# of compiling the sources again (with PYTHONDONTWRITEBYTECODE set, none would ever be written).
test: setup
	$(PY) -m compileall -q snapshotd client proto bench tests
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup -m "not serial and not long" --durations=10; first=$$?; \
	test $$first -ne 2 || exit 2; \
	$(PY) -m pytest -q -p no:cacheprovider -m "serial and not long" --durations=20; second=$$?; \
	test $$first -eq 0 -a $$second -eq 0

lint: setup
	$(VENV)/bin/ruff check snapshotd client proto bench tests
	$(VENV)/bin/ruff format --check snapshotd client proto bench tests
	$(VENV)/bin/mypy snapshotd client proto bench

demo: setup
	$(VENV)/bin/snapshotd demo

bench: setup
	$(VENV)/bin/snapshotd-bench codec
	$(VENV)/bin/snapshotd-bench transport
	$(VENV)/bin/snapshotd-bench overhead
	$(VENV)/bin/snapshotd-bench recovery

# a million random and mutated messages at each live socket (the coordinator's, a sidecar's data and ipc ones)
fuzz: setup
	$(VENV)/bin/snapshotd-bench fuzz --messages 1000000

# a hundred trials of a training job meeting a random fault (seed printed), each checked bit-identical
soak: setup
	$(VENV)/bin/snapshotd-bench soak --trials 100

# the stories kept out of make test for its time (marked long)
long: setup
	$(PY) -m pytest -q -p no:cacheprovider -m long

clean:
	rm -rf $(VENV) build *.egg-info

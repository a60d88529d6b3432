# Two commands do all set-up on a fresh machine:  make demo  |  make test
PY ?= python3
# The torch that set-up installs when none is present (the CPU wheel on the development machines).
TORCH ?= torch==2.13.0
# Tested versions of everything else (constraints.txt); `make test-latest` ignores them.
CONSTRAINTS ?= constraints.txt
LATEST ?= .venv-latest

.PHONY: torch install setup demo test test-gpu test-latest
torch:
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"

# What the demo needs: torch and the package (with ninja, which builds the C++ CPU kernel), and
# numpy, without which torch warns at its first tensor conversion.
install: torch
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e . numpy

# What the test suite needs: the package with its test extras (pytest, hypothesis, transformers, Triton),
# and CUTLASS's C++ headers (the nvidia-cutlass wheel without the Python packages its DSL needs), which
# the CUDA sources' compile check (python -m twell_compile.build --check) reads.
setup: torch
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[test]"
	$(PY) -m pip install -q --no-deps -c $(CONSTRAINTS) nvidia-cutlass

demo: install
	$(PY) examples/quickstart.py

test: setup
	$(PY) -m pytest -q -p no:cacheprovider

test-gpu:
	$(PY) -m pytest -q -m gpu

# The suite against today's newest releases of every dependency but torch, in a fresh venv
# (TORCH=torch takes the newest torch that pyproject allows as well).
test-latest:
	rm -rf $(LATEST)
	$(PY) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q "$(TORCH)"
	$(LATEST)/bin/python -m pip install -q -U --upgrade-strategy eager -e ".[test]"
	$(LATEST)/bin/python -m pip freeze --exclude-editable | grep -iE "^(torch|triton|pytest|hypothesis|transformers|numpy)=="
	$(LATEST)/bin/python -m pytest -q -p no:cacheprovider

# Two commands do all set-up on a fresh machine:  make demo  |  make test
PY ?= python3

.PHONY: setup demo test test-gpu
setup:
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"

demo: setup
	$(PY) examples/quickstart.py

test: setup
	$(PY) -m pytest -q -x -p no:cacheprovider

test-gpu:
	$(PY) -m pytest -q -m gpu

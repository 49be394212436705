# Two entry points, each creating its own virtual environment on a fresh machine:
#   make demo   runs the main job
#   make test   runs the whole test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: demo test clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q -e '.[test,reference]'
	# the speculators format's reference classes, without the CUDA torchvision its metadata pulls in (the
	# reference extra lists what it imports)
	$(PY) -m pip install -q --no-deps speculators==0.9.0
	touch $@

demo: $(VENV)/.base
	$(PY) -m dspark_jax.demo

test: $(VENV)/.test
	$(PY) -m pytest -q -n 2 tests

clean:
	rm -rf $(VENV)

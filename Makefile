# Every target sets itself up: a fresh machine needs only python3 (3.10+) and make.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Offline; PYTHONDONTWRITEBYTECODE emptied, so that Python writes a module's bytecode at its first import (install).
RUN_ENV := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONDONTWRITEBYTECODE=

.PHONY: install test demo bench results lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# --no-compile: pip would compile all 16,000 Python files of torch, transformers and the rest up front (about
	# 100 s on 2 cores); most are never imported here, and Python compiles the others at their first import.
	$(PY) -m pip install --quiet --no-compile -e ".[dev]"
	# One import of what every script and test process imports: it checks the install, and compiles that bytecode
	# once rather than in each of the first processes of a parallel test run at the same time.
	$(RUN_ENV) $(PY) -c "import torch, transformers, accelerate, datasets, timm, peft, matplotlib.pyplot; \
		from hf_cpt import CPTTrainer, quantize_model"
	touch $(STAMP)

# Two pytest workers, one thread each (tests/conftest.py): most tests run tiny models, bound by Python on one core.
# The checkpoint tests that load the same trained checkpoints stay on one worker (xdist_group).
TEST_WORKERS ?= 2

# Then the layers' tests again on the other CPU path (HF_CPT_INT8_DOT: int8 dot products forced off where the CPU has
# them, on where it has not), so that both paths run on every machine.
OTHER_PATH_TESTS := tests/test_nn.py tests/test_integer_matmul.py tests/test_recompute.py tests/test_composition.py \
	tests/test_backends.py tests/test_code_kernels.py tests/test_backward_products.py tests/test_weight_ranges.py

test: install
	$(RUN_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup
	$(RUN_ENV) HF_CPT_INT8_DOT=$$($(PY) -c "from hf_cpt.backends.cpu import cpu_reports_int8_dot as has; \
		print(0 if has() else 1)") $(PY) -m pytest -q -n $(TEST_WORKERS) $(OTHER_PATH_TESTS)

demo: install
	$(RUN_ENV) $(PY) recipes/demo.py --output_dir outputs/demo

bench: install
	$(RUN_ENV) $(PY) bench/overhead.py
	$(RUN_ENV) $(PY) bench/op_counts.py
	$(RUN_ENV) $(PY) bench/kept_memory.py
	$(RUN_ENV) $(PY) bench/kernel_costs.py

# Results on real data and a real pretrained model (../shared/data; each script about 40 minutes on
# 2 cores; resumable: a finished run is skipped), then docs/RESULTS.md, docs/pretrained.md, README summary.
results: install
	$(PY) -m pip install --quiet -e ".[bench]"
	$(RUN_ENV) $(PY) bench/cifar10.py
	$(RUN_ENV) $(PY) bench/pretrained.py
	$(RUN_ENV) $(PY) bench/language_model.py
	$(RUN_ENV) $(PY) bench/language_model.py --epochs 6 --runs fp32 static-8/8-full cpt-4-8/8-full --no_profile \
		--output bench/results/language_model_full.json
	$(RUN_ENV) $(PY) bench/schedule_sweep.py
	$(RUN_ENV) $(PY) bench/horizon.py
	$(PY) bench/report.py

lint: install
	$(PY) -m ruff check hf_cpt tests bench recipes

clean:
	rm -rf $(VENV) outputs .pytest_cache

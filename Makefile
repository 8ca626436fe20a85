# Set-up pins torch to the CPU wheel first (a bare `torch` requirement would pull a multi-GB CUDA build);
# the library itself only asks for torch>=2.3.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
REPORTS ?= reports
# pytest-xdist processes for `make test`, one torch thread each (tests/conftest.py); a test file runs in one of them
TEST_WORKERS ?= 2

.PHONY: setup demo test system-deps docs clean bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

# Headless Chromium (browser test of the HTML report) and poppler (PDF to PNG), from Debian's packages.
system-deps:
	@command -v chromium >/dev/null 2>&1 && command -v pdftoppm >/dev/null 2>&1 || \
	  { (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium poppler-utils fonts-dejavu-core >/dev/null) \
	    || echo "note: could not install chromium/poppler-utils; the browser test will be skipped"; }

demo: setup
	$(VENV)/bin/lowrank-audit sample_models/digits.py:mlp --format text,json,md,html,pdf -o $(REPORTS) \
	  --emit-plan $(REPORTS)/suggested-plan.toml
	$(VENV)/bin/lowrank-audit sample_models/chargpt.py:chargpt --calibration sample_models/chargpt_calib.safetensors \
	  --holdout sample_models/chargpt_holdout.safetensors --fail-on never --format text,json,md,html,pdf \
	  -o $(REPORTS)/chargpt
	$(VENV)/bin/lowrank-audit sample_models/llama --calibration sample_models/llama/calib.txt \
	  --holdout sample_models/llama/holdout.txt --fail-on never --format text,json,md,html,pdf -o $(REPORTS)/llama
	@echo "reports written to $(REPORTS)/ (open $(REPORTS)/lowrank-audit.html or .pdf), $(REPORTS)/chargpt/ and $(REPORTS)/llama/"

test: setup system-deps
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

docs: setup
	$(VENV)/bin/lowrank-audit rules --markdown > docs/rules.md
	$(PY) -c "from auditor.render.parts.registries import registries_markdown as m; print(m(), end='')" > docs/registries.md

clean:
	rm -rf $(VENV) $(REPORTS)

# Benchmarks run in their own venv so that weightwatcher (compared against) never enters the project's.
BENCH_VENV ?= .bench-venv
$(BENCH_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(BENCH_VENV)/bin/python -m pip install -q -e ".[test]" weightwatcher==0.7.7
	touch $@

bench: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python benchmarks/spectra.py
	$(BENCH_VENV)/bin/python benchmarks/structure_7b.py
	$(BENCH_VENV)/bin/python benchmarks/render.py
	$(BENCH_VENV)/bin/python benchmarks/sharded_checkpoint.py

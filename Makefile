# Two commands do everything on a fresh machine with Python 3.10+:
#   make pilot   run the pilot notebooks on the default sample task into a new runs/ folder
#   make test    lint, the docs site, unit tests, notebook regression (papermill) and nbval
# Each creates .venv if missing, installs the project and registers the `workbook` kernel.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CI pins the small CPU build (TORCH=torch==2.13.0); by default pip picks a build for your machine.
TORCH ?= torch>=2.6
STAMP := $(VENV)/.installed
PILOT_ARGS ?=

# Kernels started by the tests create no live widgets (they can hang under papermill/nbval).
export WORKBOOK_HEADLESS := 1
# Test processes side by side (pytest-xdist; TEST_JOBS=0 runs them in one). `loadfile` keeps each
# notebook's cells, which share one kernel, on one worker; files are handed out in the order
# tests/conftest.py gives (the heaviest first, HEAVIEST_FIRST), not re-sorted by xdist. One
# OpenMP thread per process: two workers, each with kernels and subprocesses, on 2 cores stall in
# OpenMP's spin-waits otherwise.
TEST_JOBS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile \
	--no-loadscope-reorder notebooks tests \
	--nbval --nbval-kernel-name workbook --nbval-sanitize-with tests/nbval_sanitize.cfg \
	--nbval-cell-timeout 300
# JupyterLab refuses to start as root without this flag (containers, CI images).
LAB_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: install prepare pilot test test-all lint docs lab bench samples clean-venv gpu-wheels gpu-check

# pip byte-compiles what it installs on one core; compileall -j0 does it on all of them (a file
# only a newer Python compiles, such as torch's py312 test helpers, fails there as it does,
# unsaid, under pip). ipykernel stages the kernel spec in a folder of TMPDIR that it leaves behind
# (empty): one of the venv's here, removed.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile "$(TORCH)" -e ".[test,hf,llm,lightning,stream,export]"
	$(BIN)/python -m compileall -qq -j0 $(VENV)/lib || true
	mkdir -p $(VENV)/.kernelspec-tmp
	TMPDIR=$(abspath $(VENV))/.kernelspec-tmp $(BIN)/python -m ipykernel install --sys-prefix \
		--name workbook --display-name "Python (workbook)"
	rm -rf $(VENV)/.kernelspec-tmp
	touch $(STAMP)

# SkyPilot's own parser for 08's launch files, in a venv of its own: skypilot 0.14 pins click<8.2,
# which huggingface-hub 2.x (the hf extra) refuses, so it cannot share the project's venv.
# tests/notebooks/test_launch_files.py loads each YAML there with sky.Task.from_yaml (offline).
LAUNCH_VENV ?= .venv-launch
LAUNCH_STAMP := $(LAUNCH_VENV)/.installed
$(LAUNCH_STAMP):
	test -x $(LAUNCH_VENV)/bin/python || $(PYTHON) -m venv $(LAUNCH_VENV)
	$(LAUNCH_VENV)/bin/python -m pip install -q "skypilot==0.14.1"
	touch $(LAUNCH_STAMP)

# The two venvs are independent, and pip unpacks wheels on one core: built side by side (a
# sub-make with -j, whatever -j you gave), the launch venv takes no time of its own. Ctrl-C
# stops both pips (make's children); a venv left without its stamp is completed by the next run.
install:
	@$(MAKE) --no-print-directory -j2 $(STAMP) $(LAUNCH_STAMP)

pilot: $(STAMP)
	$(BIN)/python -m workbook pilot $(PILOT_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check workbook tests notebooks benchmarks data_samples examples

# The reference in docs/ as a site (build/site); --strict: a broken link or a page left out of
# the navigation fails the build.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir build/site

# What the tests need, side by side: the two venvs, then lint and the docs site.
prepare:
	@$(MAKE) --no-print-directory -j3 lint docs $(LAUNCH_STAMP)

# Unit tests, planted bugs, papermill regression and nbval: 5:16-5:29 of pytest on an idle 2-core
# machine, 6:18-6:44 with the install (the target is 6:00 in all; the 25 slowest are listed at
# the end, to see which to make cheaper when a feature adds tests).
test: prepare
	$(PYTEST) -m "not slow" --durations=25

# Everything, including the slow soak tests (kills at random points, both samples everywhere).
test-all: prepare
	$(PYTEST)

lab: $(STAMP)
	WORKBOOK_HEADLESS=0 $(BIN)/jupyter lab $(LAB_ROOT) notebooks

bench: $(STAMP)
	$(BIN)/python benchmarks/loop_overhead.py

samples:
	$(PYTHON) data_samples/make_samples.py

# The CUDA path proved on a lent GPU (benchmarks/gpu_check.py). Here, online: the wheels the GPU
# image lacks (papermill, the Jupyter kernel, nbval, pydantic, TRL) into .whl/ (ignored, ~20 MiB).
gpu-wheels: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py --prepare

# There, offline, with .whl/ carried: install them beside the image's torch and run the check.
gpu-check:
	python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
		--target /tmp/site .whl/*.whl
	PYTHONPATH=/tmp/site:$(CURDIR) PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py

clean-venv:
	rm -rf $(VENV)

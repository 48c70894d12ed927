# The two commands of the README:   make test   (set up + run the tests)   and   make demo   (the main job)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.gradpress-installed

.PHONY: test demo clean lint wheel-check

# pip installs without byte-compiling (on one core, every file of torch: most of its install time); Python
# writes each module's bytecode the first time a process imports it, whatever the environment says, so the
# suite's many processes read torch's compiled modules instead of compiling its sources each time
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# the CPU build of torch that lies on this kind of machine; a plain `pip install torch` pulls CUDA (GBs)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --no-compile torch==2.13.0
	# the extras (lightning, accelerate) must not replace that torch: pin the installed one
	$(PY) -m pip install -q --no-compile -e ".[test]" "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	touch $(STAMP)

# the kernels compiled for the suite are kept in one folder that the wheel check's virtualenv reads too
# (installs of one version share a GRADPRESS_CACHE); set it to keep them elsewhere
test wheel-check: export GRADPRESS_CACHE ?= $(CURDIR)/build/cache

test: $(STAMP)
	# the offline datasets (apt-get as root; tests that need one skip with the reason when it is missing)
	-$(PY) -m gradpress data fashion-mnist fortunes movielens-100k
	# every method's kernels compiled once for the suite, two processes at a time (numba compiles on one
	# core); the tests then load them from the disk cache, in two processes (pytest-xdist), a file each,
	# the longest files first (tests/conftest.py; xdist's own order is by number of tests)
	$(PY) -m gradpress compile all --jobs 2 --dtypes float32
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder
	# the lint (one core) beside the wheel check (mostly one core)
	$(MAKE) --no-print-directory -j 2 --output-sync=target lint wheel-check

# the checks of the code: pyflakes, bugbear and import order (ruff), types (mypy; configured in pyproject.toml)
lint: $(STAMP)
	$(PY) -m ruff check gradpress tests
	$(PY) -m mypy

# the wheel `python -m build` makes, installed into a fresh virtualenv (torch as above, no extras), runs
# the README's quick-start from outside the checkout
WHEEL_CHECK := build/wheel-check
wheel-check: $(STAMP)
	rm -rf $(WHEEL_CHECK) && mkdir -p $(WHEEL_CHECK)
	$(PY) -m build --wheel --outdir $(WHEEL_CHECK)/dist . > $(WHEEL_CHECK)/build.log 2>&1 || (cat $(WHEEL_CHECK)/build.log; exit 1)
	$(PYTHON) -m venv $(WHEEL_CHECK)/venv
	$(WHEEL_CHECK)/venv/bin/python -m pip install -q --no-compile torch==2.13.0
	$(WHEEL_CHECK)/venv/bin/python -m pip install -q --no-compile $(WHEEL_CHECK)/dist/*.whl
	cd $(WHEEL_CHECK) && venv/bin/python $(CURDIR)/tests/installed_quickstart.py $(CURDIR)/README.md

# an emulated 100 Mbit/s star when root (network namespaces need it), loopback otherwise
NETWORK := $(if $(filter 0,$(shell id -u)),--bandwidth 100mbit,)
# every method trains for the same wall-clock (evaluation excluded), so fast and slow ones compare fairly
DEMO_SECONDS ?= 30

demo: $(STAMP)
	$(PY) -m gradpress data fashion-mnist
	$(PY) -m gradpress bench ops --compressors all --json out/bench_ops.json
	$(PY) -m gradpress compare --model mlp --data fashion-mnist --workers 2 $(NETWORK) \
		--seconds $(DEMO_SECONDS) --eval-every 25 --compressors demo --out out/demo --overwrite

clean:
	rm -rf $(VENV) out build

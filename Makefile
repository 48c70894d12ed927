# The two commands of the README:   make test   (set up + run the tests)   and   make demo   (the main job)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.gradpress-installed

.PHONY: test demo clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# the CPU build of torch that lies on this kind of machine; a plain `pip install torch` pulls CUDA (GBs)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	# the extras (lightning, accelerate) must not replace that torch: pin the installed one
	$(PY) -m pip install -q -e ".[test]" "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	touch $(STAMP)

test: $(STAMP)
	# the offline datasets (apt-get as root; tests that need one skip with the reason when it is missing)
	-$(PY) -m gradpress data fashion-mnist fortunes movielens-100k
	$(PY) -m pytest -q

# an emulated 100 Mbit/s star when root (network namespaces need it), loopback otherwise
NETWORK := $(if $(filter 0,$(shell id -u)),--bandwidth 100mbit,)
DEMO_STEPS ?= 300

demo: $(STAMP)
	$(PY) -m gradpress data fashion-mnist
	$(PY) -m gradpress bench ops --compressors all --json out/bench_ops.json
	$(PY) -m gradpress compare --model mlp --data fashion-mnist --workers 2 $(NETWORK) \
		--steps $(DEMO_STEPS) --eval-every 50 --compressors demo --out out/demo

clean:
	rm -rf $(VENV) out

# openjev-serving: two commands on a fresh machine.
#   make demo   create .venv (pinned CPU environment) and run the main job on the embedded default
#   make test   create .venv if needed and run the test suite (what CI runs)
#   make test-fast  the tests that start no server and no real-SGLang venv, on every core (minutes)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: demo test test-fast venv clean-demo

demo: venv
	bash app/run_demo.sh

# Versions of stock SGLang whose real classes the adapter and launcher tests run against, each in
# its own pinned venv (requirements-sglang-<version>.txt, made by .ci/sglang_venv.sh, reused while
# its stamp matches). OPENJEV_SGLANG_VERSIONS= (empty) leaves them out.
OPENJEV_SGLANG_VERSIONS ?= 0.5.13 0.5.14 0.5.23
SGLANG_TESTS := tests/test_sglang_openjev_weights.py tests/test_sglang_openjev_pooling.py \
  tests/test_sglang_openjev_launcher.py tests/test_sglang_openjev_warmup.py tests/test_sglang_openjev_routes.py \
  tests/test_sglang_openjev_model_loading.py tests/test_sglang_openjev_launcher_in_sglang.py \
  tests/test_serve_sglang_v100_command.py tests/test_serve_sglang_v100_runtimes.py
# Tests a version cannot run yet, by name, with the reason test-sglang prints (shown as deselected):
# SGLANG_DESELECT_<version> := --deselect tests/...::test_name, SGLANG_DESELECT_WHY_<version> := reason.
# None at present.
# Modules run only in one version's venv: 0.5.23's real CPU engine with the adapter (the CPU
# ops are tests/openjev_testsupport's stand-ins, sgl-kernel's CPU library cannot be installed here).
# They go first, in a worker of their own (--no-loadscope-reorder: xdist would queue the module with
# the fewest tests last, behind another module on one worker).
SGLANG_EXTRA_TESTS_0.5.23 := tests/test_sglang_cpu_engine.py

.PHONY: provision sglang-venvs test-sglang

# -rs prints the reason of every skipped test; pytest's exit 5 (no tests collected) fails make.
# `make test` = provision (apt packages when root with apt), the suite in .venv (on every core with
# pytest-xdist), then the serial tests, beside them at nice 10 the SGLang adapter/launcher tests in
# each real-SGLang venv (OPENJEV_REQUIRE_SGLANG=1 turns their "sglang not importable" skips into
# failures there). The serial tests use about one core; the niced tests take what they leave and
# yield it whenever a serial test wants it.
# The real-SGLang venvs (mostly unpacking wheels) are built in the background while the main suite
# runs; their log is printed when both are done.
test: venv provision
	@mkdir -p build; log=build/sglang-venvs.log; \
	  $(MAKE) --no-print-directory sglang-venvs >$$log 2>&1 & venvs=$$!; \
	  echo "real-SGLang venvs: built in the background beside the main suite (log: $$log)"; \
	  $(PY) -m pytest -rs -n auto -m "not serial" tests; rc=$$?; \
	  wait $$venvs; vrc=$$?; cat $$log; \
	  [ $$rc -eq 0 ] || exit $$rc; [ $$vrc -eq 0 ] || { echo "real-SGLang venvs: failed (log above)"; exit $$vrc; }
	@log=build/test-sglang.log; nice -n 10 $(MAKE) --no-print-directory test-sglang >$$log 2>&1 & sgl=$$!; \
	  echo "real-SGLang tests: beside the serial tests, at a lower CPU priority (log: $$log)"; \
	  $(PY) -m pytest -rs -m serial tests; rc=$$?; \
	  wait $$sgl; src=$$?; cat $$log; [ $$rc -eq 0 ] && [ $$src -eq 0 ]

# The fast tier: every test not marked slow (tests/conftest.py marks what starts servers or runs
# script pipelines), spread over the cores by pytest-xdist.
test-fast: venv
	$(PY) -m pytest -q -rs -m "not slow" -n auto tests

provision:
	sh .ci/provision.sh

# One call for all versions: what their requirement files pin alike is installed once (a shared
# base, hard-linked into each venv; .ci/sglang_venv.sh says how).
sglang-venvs:
	@if [ -n "$(strip $(OPENJEV_SGLANG_VERSIONS))" ]; then PYTHON=$(PYTHON) sh .ci/sglang_venv.sh $(OPENJEV_SGLANG_VERSIONS); fi

test-sglang: sglang-venvs
	@for v in $(OPENJEV_SGLANG_VERSIONS); do \
	  if [ -f build/sglang-venvs/$$v.unavailable ]; then \
	    echo "SKIPPED real-SGLang $$v tests: $$(cat build/sglang-venvs/$$v.unavailable)"; continue; fi; \
	  echo "== real SGLang $$v: $(SGLANG_TESTS)"; deselect=""; \
	  $(foreach v,$(OPENJEV_SGLANG_VERSIONS),$(if $(SGLANG_DESELECT_$(v)),if [ $$v = $(v) ]; then \
	    deselect="$(SGLANG_DESELECT_$(v))"; echo "   deselected on $(v): $(SGLANG_DESELECT_WHY_$(v))"; fi;)) \
	  extra=""; $(foreach v,$(OPENJEV_SGLANG_VERSIONS),$(if $(SGLANG_EXTRA_TESTS_$(v)),if [ $$v = $(v) ]; then \
	    extra="$(SGLANG_EXTRA_TESTS_$(v))"; echo "   and on $(v) only: $(SGLANG_EXTRA_TESTS_$(v))"; fi;)) \
	  start=$$(date +%s); \
	  OPENJEV_REQUIRE_SGLANG=1 build/sglang-venvs/$$v/bin/python -m pytest -rs -p no:cacheprovider -n auto --dist loadfile \
	    --no-loadscope-reorder $$deselect $$extra $(SGLANG_TESTS) || exit 1; \
	  echo "== real SGLang $$v: done in $$(( $$(date +%s) - start )) s"; \
	done

venv: $(VENV)/.requirements.stamp

# --no-compile: the tests run with PYTHONPYCACHEPREFIX (tests/conftest.py), so Python never reads the
# __pycache__ pip would write into site-packages; anything else compiles what it imports on first use.
$(VENV)/.requirements.stamp: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -r requirements.txt
	$(PY) -m pip install --quiet --no-compile --no-deps -e .
	touch $@

clean-demo:
	rm -rf build/demo

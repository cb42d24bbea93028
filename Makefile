# genai-ratelimit: `make demo` shows the limiter working, `make test` runs the whole suite.
# Both install what they need (Debian packages when missing, a venv in .venv).

PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
PYTEST_ARGS ?=
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: help deps venv install build test test-fast test-asan test-valgrind demo serve bench dist clean

help:
	@echo "make demo           start a throwaway Redis + the example app, fire a burst, print the table"
	@echo "make test           build the C extension and run the whole test suite"
	@echo "make test-asan      the suite with the extension built under AddressSanitizer + UBSan"
	@echo "make test-valgrind  the core suite under valgrind memcheck"
	@echo "make serve          keep the example app running for your own curl"
	@echo "make bench          benchmarks side by side (QUICK=1 for a short run)"
	@echo "make dist           sdist + wheel into dist/"

deps:
	@PYTHON=$(PYTHON) bash scripts/ensure-system-deps.sh

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	@touch $@

venv: deps $(VENV)/.created

# Builds and installs the package (not editable: the tests import what a user would get).
install: venv
	GENAI_RATELIMIT_WERROR=1 $(PIP) install -q --no-build-isolation ".[test]"

test: install
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# The suite without the slow tests (the real 61-second wait, the sdist round trip).
test-fast: install
	$(VENV)/bin/pytest -m "not slow" $(PYTEST_ARGS)

test-asan: venv
	GENAI_RATELIMIT_SANITIZE=1 $(PIP) install -q --no-build-isolation --force-reinstall --no-deps .
	$(PIP) install -q ".[test]"
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	$(VENV)/bin/pytest -m "not slow" -p no:cacheprovider $(PYTEST_ARGS)

test-valgrind: venv
	GENAI_RATELIMIT_DEBUG=1 $(PIP) install -q --no-build-isolation --force-reinstall --no-deps .
	$(PIP) install -q ".[test]"
	PYTHONMALLOC=malloc valgrind --quiet --error-exitcode=99 --leak-check=no \
	  --suppressions=scripts/valgrind-python.supp \
	  $(PY) -m pytest -m "not slow" -p no:cacheprovider tests/test_limiter_core.py $(PYTEST_ARGS)

demo: install
	$(PY) examples/demo.py

serve: install
	$(PY) examples/serve.py

bench: install
	$(PIP) install -q ".[bench]"
	$(PY) benchmarks/run.py $(if $(QUICK),--quick,)

dist: venv
	$(PIP) install -q build
	$(PY) -m build --no-isolation

clean:
	rm -rf build dist *.egg-info $(VENV) csrc/script_source.h benchmarks/bin
	find . -name __pycache__ -prune -exec rm -rf {} +

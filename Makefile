# Two commands for a newcomer:  `make run` (set up, then every lesson's smoke script)
#                               `make test` (set up, then the graded test suite)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch 2.13.0 is the CPU build available offline here; a plain `pip install torch` would pull
# several GB of CUDA wheels. An already-installed torch (e.g. a CUDA build) is used as it is.
TORCH  ?= torch==2.13.0

.PHONY: run test setup smoke bench student-copy clean

run: setup
	@for s in scripts/l*_smoke.py; do echo "== $$s"; $(PY) $$s || exit 1; done

test: setup
	$(PY) -m pytest

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH)"
	$(PY) -m pip install -e ".[dev]"
	touch $(STAMP)

# L1-L3 print their tables; L5 and L8 also rewrite their sections of docs/benchmarks.md, under a
# regenerated header (machine, versions, date). Each takes a few minutes on a 2-core CPU.
bench: setup
	@for s in scripts/bench_l1.py scripts/bench_l2.py scripts/bench_l3_kernel.py; do echo "== $$s"; $(PY) $$s || exit 1; done
	$(PY) -c "from harness.benchmark import write_header; write_header('docs/benchmarks.md')"
	$(PY) scripts/bench_l5.py --markdown docs/benchmarks.md
	$(PY) scripts/bench_l8.py --markdown docs/benchmarks.md

student-copy: setup
	$(PY) scripts/make_student_copy.py student-copy --force

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis student-copy

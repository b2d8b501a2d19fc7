# Two-command quick start: `make demo`, `make test`. Each sets up .venv itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned: 2.13.0 is the CPU build; an unpinned torch pulls a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: venv demo demo-loop test test-unit lint bench clean zoo zoo-heldout zoo-tuning fuzz log-draws-tuning log-draws-heldout

$(BIN)/.ready: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]' $(TORCH)
	touch $@

venv: $(BIN)/.ready

# A small incident (a real training run hit by a poisoned batch at step 35), then the
# main job on it: replay the window from the step-30 checkpoint and write the report.
demo: venv
	$(BIN)/python fixtures/zoo.py --out build/demo --only poison_batch
	$(BIN)/ckptforensics replay --run-dir build/demo/poison_batch --before 30 --after 35 \
		--model fixtures/tinygpt.py:factory --batch build/demo/poison_batch/batches.h5 --out build/demo/report
	@echo "report: build/demo/report/report.md"

# The on-call loop's second half on the demo incident: the resume plan, the resume as planned
# (the zoo's own loop), and whether the resumed run recovered.
demo-loop: demo
	$(BIN)/ckptforensics plan --run-dir build/demo/poison_batch --before 30 --after 35 \
		--model fixtures/tinygpt.py:factory --batch build/demo/poison_batch/batches.h5 --out build/demo/plan
	$(BIN)/python fixtures/resume_runs.py --apply build/demo/plan --run build/demo/poison_batch --out build/demo/resumed
	$(BIN)/ckptforensics recovery --run-dir build/demo/resumed --resumed-from 30 --plan build/demo/plan --out build/demo/recovery
	@echo "plan: build/demo/plan/report.md; recovery: build/demo/recovery/report.md"

zoo: venv
	$(BIN)/python fixtures/zoo.py --out build/zoo

# Drawn incidents (fixtures/draws.py): the tuning split is looked at while developing; the
# held-out split (60 draws) is only scored, and recorded in bench/RESULTS.md.
zoo-tuning: venv
	$(BIN)/python bench/zoo.py --draws tuning --jobs 2

zoo-heldout: venv
	rm -rf build/draws/heldout build/draws/heldout-reports
	$(BIN)/python bench/zoo.py --draws heldout --record --jobs 2

# triage on log-only draws (fixtures/log_draws.py): noisy logs, hard batches, excerpts.
log-draws-tuning: venv
	$(BIN)/python bench/log_draws.py --split tuning --build

log-draws-heldout: venv
	rm -rf build/log-draws/heldout
	$(BIN)/python bench/log_draws.py --split heldout --build --record

# Two workers (CI has two cores); a module's tests stay on one worker (tests/conftest.py).
test: venv
	$(BIN)/ruff check ckptforensics tests fixtures bench
	$(BIN)/ruff format --check -q ckptforensics tests fixtures bench
	$(BIN)/python -m pytest -q -n 2

# The fast tier: no training, under a minute.
test-unit: venv
	$(BIN)/python -m pytest -q -n 2 tests/unit

# A longer fuzzing campaign than CI's seeded one.
fuzz: venv
	CKPTFORENSICS_FUZZ_EXAMPLES=2000 $(BIN)/python -m pytest -q tests/test_fuzz.py

lint: venv
	$(BIN)/ruff check ckptforensics tests fixtures bench
	$(BIN)/ruff format --check ckptforensics tests fixtures bench

bench: venv
	$(BIN)/python bench/diff_throughput.py

clean:
	rm -rf build .pytest_cache

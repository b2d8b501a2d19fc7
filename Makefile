# Two-command quick start: `make demo`, `make test`. Each sets up .venv itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned: 2.13.0 is the CPU build; an unpinned torch pulls a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: venv demo test lint bench clean zoo

$(BIN)/.ready: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]' $(TORCH)
	touch $@

venv: $(BIN)/.ready

# A small incident (a silent bit flip in a real training run), then the main job on it.
demo: venv
	$(BIN)/python fixtures/zoo.py --out build/demo --only silent_corruption
	$(BIN)/ckptforensics diff --run-dir build/demo/silent_corruption --before 30 --after 40 --out build/demo/report
	@echo "report: build/demo/report/report.md"

zoo: venv
	$(BIN)/python fixtures/zoo.py --out build/zoo

test: venv
	$(BIN)/ruff check ckptforensics tests fixtures bench
	$(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check ckptforensics tests fixtures bench

bench: venv
	$(BIN)/python bench/diff_throughput.py

clean:
	rm -rf build .pytest_cache

# The two commands of the README: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CORES ?= all

.PHONY: install demo test lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --editable '.[dev]'
	touch $@

demo: install
	$(BIN)/slidesnake demo-slides demo/slides
	$(BIN)/snakemake --cores $(CORES)
	$(BIN)/snakemake --report results/report.html
	@echo
	@echo "Done. Per slide, under results/<slide_id>/:"
	@echo "  tissue_mask.png  qc_mask.png (tissue outline)  tiles.parquet  qc_tiles.png (kept tiles)"
	@echo "QC pictures of the whole cohort: results/report.html (open it in a browser)"

test: install
	$(BIN)/pytest

lint: install
	$(BIN)/slidesnake demo-slides demo/slides
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/snakefmt --check Snakefile workflow
	$(BIN)/snakemake --lint

bench: install
	$(BIN)/python benchmarks/mask_tiles_scaling.py

clean:
	rm -rf results logs demo .snakemake

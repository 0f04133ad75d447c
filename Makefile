# The two commands of the README: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CORES ?= all

SERVE_VENV := .venv-serve
SERVE_STAMP := $(SERVE_VENV)/.installed

# The oldest torch pyproject.toml accepts, and its torchvision: `make test-floor`.
FLOOR_VENV := .venv-floor
FLOOR_STAMP := $(FLOOR_VENV)/.installed
FLOOR_TORCH := 2.3.0
FLOOR_TORCHVISION := 0.18.0

PEER_VENV := .venv-peer
PEER_STAMP := $(PEER_VENV)/.installed

.PHONY: install constraints docs test-fast test-floor floor-env gpu-kit gpu-kit-offline serve-env peer-env readers-env demo test lint bench bench-slurm bench-remote bench-peer gpu-check clean

install: $(STAMP)

# The versions CI tests, from envs/constraints.txt; pyproject.toml only holds ranges.
$(STAMP): pyproject.toml envs/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --constraint envs/constraints.txt --editable '.[dev]'
	touch $@

# After an upgrade that CI has passed: pin what .venv now holds.
constraints: install
	{ sed -n '1,3p' envs/constraints.txt; $(BIN)/pip freeze --exclude-editable; } > envs/constraints.new
	mv envs/constraints.new envs/constraints.txt

# `slidesnake serve` runs here: a second environment, because PyTriton pins numpy<2.
serve-env: $(SERVE_STAMP)

$(SERVE_STAMP): envs/serve-requirements.txt pyproject.toml
	$(PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/pip install --quiet --requirement envs/serve-requirements.txt
	$(SERVE_VENV)/bin/pip install --quiet --no-deps --editable .
	touch $@

# The floor's torch first (PyPI's Linux wheels, CUDA inside, run on a CPU), then the
# package with CI's pins for everything else: pip keeps the torch it finds. No pip cache:
# the floor's 2.5 GB of wheels would be held twice on disk (CI once ran out of space).
floor-env: $(FLOOR_STAMP)

$(FLOOR_STAMP): pyproject.toml envs/constraints.txt
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/pip install --quiet --no-cache-dir torch==$(FLOOR_TORCH) torchvision==$(FLOOR_TORCHVISION)
	grep -v -E '^(torch|torchvision|triton|nvidia-|cuda-)' envs/constraints.txt \
		> $(FLOOR_VENV)/constraints.txt
	$(FLOOR_VENV)/bin/pip install --quiet --no-cache-dir --constraint $(FLOOR_VENV)/constraints.txt \
		--editable '.[dev]'
	touch $@

# slide2vec and TRIDENT, for benchmarks/cohort_vs_peer.py: their own environment, their
# own pins. TRIDENT is not on PyPI: TRIDENT_SRC names a checkout of
# github.com/mahmoodlab/TRIDENT (the benchmarks ran a91fa84); without it, slide2vec only.
TRIDENT_SRC ?=
peer-env: $(PEER_STAMP)

$(PEER_STAMP): envs/peer-requirements.txt
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install --quiet --no-deps slide2vec==7.1.4 hs2p==6.1.0 cucim-cu12==26.10.0
	$(PEER_VENV)/bin/pip install --quiet --requirement envs/peer-requirements.txt
	if [ -n "$(TRIDENT_SRC)" ]; then $(PEER_VENV)/bin/pip install --quiet --no-deps "$(TRIDENT_SRC)"; fi
	touch $@

# The peers' slide readers, for benchmarks/readers.py: beside .venv's packages, without
# their dependencies (cuCIM's CuPy and CUDA toolkit; its CPU reader needs neither).
READERS_SITE := benchmarks/out/readers-site
readers-env: $(READERS_SITE)/.installed

$(READERS_SITE)/.installed: install
	$(BIN)/pip install --quiet --no-deps --target $(READERS_SITE) \
		tiffslide==3.0.1 cucim-cu12==26.10.0 pyvips==3.2.0 pyvips-binary==8.18.7
	touch $@

demo: install
	$(BIN)/slidesnake demo-slides demo/slides
	$(BIN)/snakemake --cores $(CORES) --configfile config/demo.yaml
	$(BIN)/snakemake --configfile config/demo.yaml --report results/report.html
	@echo
	@echo "Done. Per slide, under results/slides/<slide_id>/:"
	@echo "  tissue_mask.png  qc_mask.png (tissue outline)  tiles.parquet  qc_tiles.png (kept tiles)"
	@echo "  embeddings.zarr (features, coords)  metrics.json (tiles/s, loader wait, memory)"
	@echo "  slide_features.parquet (mean pooling)  embedding_map.png (principal components)"
	@echo "Cohort: results/cohort.tsv, results/cohort.html (links each slide's pictures),"
	@echo "  results/slide_features.parquet (a row per slide), results/cohort_gallery.jpg,"
	@echo "  results/embedding_maps.jpg, results/slide_features_pca.png, and all of it in"
	@echo "  results/report.html (open it in a browser)"

# Two test processes, a test file each at a time (a file's servers and slides are made
# once): the tests wait on processes, servers and clusters as much as they compute.
TEST_WORKERS ?= 2
test: install
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --durations=10

# The edit-test loop: no workflow runs, servers, cluster, virtual environments or waits.
test-fast: install
	$(BIN)/pytest -n $(TEST_WORKERS) --dist worksteal -m "$(FAST)"
# The unit tests under the oldest torch we support; CI runs them after `make test`.
test-floor: floor-env
	$(FLOOR_VENV)/bin/python -c 'import sys, torch; sys.exit(None if torch.__version__.startswith("$(FLOOR_TORCH)") else f"torch {torch.__version__}, not $(FLOOR_TORCH)")'
	$(FLOOR_VENV)/bin/pytest -n $(TEST_WORKERS) --dist worksteal -m "$(FAST)" -p no:cacheprovider

FAST := not workflow and not server and not store and not slurm and not install and not real_slides and not slow

# The documentation site (MkDocs), into site/; strict: a broken link or reference fails.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

lint: install
	$(BIN)/slidesnake demo-slides demo/slides
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/snakefmt --check workflow
	$(BIN)/snakemake --lint --configfile config/demo.yaml

bench: install
	$(BIN)/python benchmarks/mask_tiles_scaling.py
	$(BIN)/slidesnake bench
	$(BIN)/python benchmarks/whole_job.py
	$(BIN)/python benchmarks/startup.py
	$(BIN)/python benchmarks/startup_sources.py
	$(BIN)/python benchmarks/cohort_loop.py
	$(BIN)/python benchmarks/model_list.py --set small
	$(BIN)/python benchmarks/model_list.py --set cheap
	$(BIN)/python benchmarks/cohort_scaling.py
	$(BIN)/python benchmarks/slides_in_place.py
	$(MAKE) readers-env
	$(BIN)/python benchmarks/readers.py

# Needs a SLURM cluster: tests/slurm/start_slurm.sh starts one here (as root).
bench-slurm: install
	$(BIN)/python benchmarks/slurm_cohort.py

bench-remote: install serve-env
	$(BIN)/python benchmarks/remote_backend.py

# Needs ../shared/slides (real pixels) and slide2vec (make peer-env): about 25 minutes here.
bench-peer: install peer-env
	$(BIN)/python benchmarks/cohort_vs_peer.py

gpu-check: install
	benchmarks/gpu_check.sh

# For the lent GPU machine (no network, its own Python 3.12 and torch): the wheels it lacks,
# into gpu-kit/, and the command that installs them there and runs the GPU check.
PYTHON312 ?= python3.12
gpu-kit: install
	PYTHON312=$(PYTHON312) $(BIN)/python benchmarks/gpu_kit.py

# The kit tried here without a GPU, offline, on a stand-in for the machine's Python.
gpu-kit-offline: gpu-kit
	PYTHON312=$(PYTHON312) $(BIN)/python benchmarks/gpu_kit_offline.py

clean:
	rm -rf results logs demo .snakemake

"""Each rule's job, given the `snakemake` object of its script: thin glue to the stages.

The scripts under scripts/ hand their `snakemake` object to `warm.run_rule`, which runs
the function named here in a warm interpreter or in the script's own process. Each
function imports its stage when called, so this module stays cheap to import, and
`warm_up` is what a warm interpreter does once to run it without waiting.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

from slidesnake.cohort.decode_method import configured
from slidesnake.cohort.jobs import run_job

TILING = ("slidesnake.tiling.stages", "slidesnake.tiling.regions")
AGGREGATE = ("slidesnake.aggregate.slide_table", "slidesnake.aggregate.embedding_map")
# The local backend's imports: torch, timm, and torch.export's deserialiser (1.7 s of a
# custom .pt2 program's load is importing it); the remote backend's lack torch.
LOCAL_EMBEDDING = (
    "slidesnake.embed.job",
    "slidesnake.embed.local_run",
    "timm",
    "torch._export.serde.serialize",
)
REMOTE_EMBEDDING = ("slidesnake.embed.job", "slidesnake.remote.served_run")
# A slide in a store: its filesystem's imports (s3fs and its AWS client: 0.3 s a job here;
# wsidicom for a DICOM series: 0.9 s).
STORES = {"s3": ("s3fs",), "gs": ("gcsfs",), "gcs": ("gcsfs",)}
SLIDE_STAGES = ("make_tissue_mask", "make_tile_coords", "embed_tiles")
_warmed: set[str] = set()


def warm_up(function: str, job: Any) -> None:
    """In a warm interpreter, before it forks `function`'s job: import what the job
    imports, once per kind. For a custom `.pt2` program, also load one program once:
    torch.export.load imports some 400 more modules on its first call (0.5-1.7 s here),
    which every job would otherwise pay."""
    for module in warm_modules(function, job):
        if module not in _warmed:
            _warmed.add(module)
            importlib.import_module(module)
    model = job.config["model"] if function == "embed_tiles" else {}
    program = model.get("checkpoint") if model.get("name") == "custom" else None
    if program and str(program).endswith(".pt2") and "program" not in _warmed:
        _warmed.add("program")
        from slidesnake.models.checkpoints import load_program

        load_program(program, "cpu")


def warm_modules(function: str, job: Any) -> tuple[str, ...]:
    """The modules `function` imports for `job`."""
    return _stage_modules(function, job) + _store_modules(function, job)


def _store_modules(function: str, job: Any) -> tuple[str, ...]:
    if function not in SLIDE_STAGES:
        return ()
    from slidesnake.slides.locator import slide_kind

    slide = str(job.params.slide)
    scheme = slide.partition("://")[0].lower()
    modules = STORES.get(scheme, ("aiohttp",) if scheme in ("http", "https") else ())
    if slide_kind(slide).dicom:
        modules = ("wsidicom", *modules)
    return tuple(m for m in modules if importlib.util.find_spec(m))  # gcsfs is optional


def _stage_modules(function: str, job: Any) -> tuple[str, ...]:
    if function == "embed_tiles":
        remote = job.config["model"].get("backend") == "remote"
        return REMOTE_EMBEDDING if remote else LOCAL_EMBEDDING
    if function == "predict_tiles":
        return ("slidesnake.aggregate.head", "slidesnake.aggregate.heatmaps")
    return {"make_tissue_mask": TILING, "make_tile_coords": TILING}.get(function, AGGREGATE)


def _read_slides_as_configured(job: Any) -> None:
    """Slides in stores are read with the run's `storage:` section in this job."""
    from slidesnake.slides.stores import configure

    configure(job.config["storage"])


def make_tissue_mask(job: Any) -> None:
    from slidesnake.tiling.artefacts import ArtefactParams
    from slidesnake.tiling.stages import make_tissue_mask
    from slidesnake.tiling.tissue import TissueParams

    _read_slides_as_configured(job)
    run_job(
        lambda: make_tissue_mask(
            slide_path=job.params.slide,
            slide_id=job.wildcards.slide_id,
            mask_path=job.output.mask,
            qc_path=job.output.qc,
            params=TissueParams.from_mapping(job.config["tissue"]),
            sheet_mpp=job.params.mpp,
            pen=ArtefactParams.from_mapping(job.config["artefacts"]).pen,
            decode=configured(job.config),
        ),
        log_path=job.log[0],
        slide_id=job.wildcards.slide_id,
    )


def make_tile_coords(job: Any) -> None:
    from slidesnake.tiling.artefacts import ArtefactParams
    from slidesnake.tiling.grid import TileParams
    from slidesnake.tiling.regions import read_regions
    from slidesnake.tiling.stages import make_tile_coords

    _read_slides_as_configured(job)

    def tile() -> None:
        slide_id, roi = job.wildcards.slide_id, job.params.tiles.get("roi")
        classes = job.config["roi"]
        regions = (
            read_regions(roi, slide_id, classes["include"], classes["exclude"]) if roi else None
        )
        make_tile_coords(
            slide_path=job.params.slide,
            slide_id=slide_id,
            mask_path=job.input.mask,
            mask_qc_path=job.input.qc,
            tiles_path=job.output.tiles,
            qc_path=job.output.qc,
            params=TileParams.from_mapping(job.config["tiles"]),
            regions=regions,
            regions_path=roi,
            coords_path=job.params.tiles.get("coords"),
            artefacts=ArtefactParams.from_mapping(job.config["artefacts"]),
        )

    run_job(tile, log_path=job.log[0], slide_id=job.wildcards.slide_id)


def embed_tiles(job: Any) -> None:
    """Claim a GPU where a model runs here, and embed the slide's tiles with the run's one
    `model:` or the models of `models:` (a served model's tiles go to its server)."""
    from slidesnake.embed.gpu_slots import claim_gpu

    _read_slides_as_configured(job)

    def embed() -> None:
        from slidesnake.cohort.job_models import job_models

        models = job_models(job.config, job.output.zarr, job.output.metrics)
        gpu = job.config["gpu"]
        # A GPU the allocation chose (SLURM) is this job's alone; one it claims is shared.
        shared = "CUDA_VISIBLE_DEVICES" not in os.environ
        if models.local:
            # Before CUDA starts (a warm interpreter has imported torch, which starts none).
            claim_gpu(gpu["ids"], jobs_per_gpu=gpu["jobs_per_gpu"])
        open_served = None
        if models.served:
            from slidesnake.remote.served_run import ServedRun as open_served  # httpx: only then
        from slidesnake.embed.job import embed_slide

        embed_slide(
            job.params.slide,
            job.wildcards.slide_id,
            job.input.tiles,
            models.outputs,
            models.settings,
            models.params,
            jobs_on_gpu=gpu["jobs_per_gpu"] if shared else 1,
            open_served=open_served,
        )

    run_job(embed, log_path=job.log[0], slide_id=job.wildcards.slide_id)


def pool_slide(job: Any) -> None:
    from slidesnake.aggregate.slide_table import slide_features, write_slide_features

    run_job(
        lambda: write_slide_features(
            slide_features(
                slide_id=job.wildcards.slide_id,
                zarr_path=job.input.zarr,
                tiles_path=job.input.tiles,
                poolings=job.config["slide"]["pooling"],
                encoder=job.config["slide"]["encoder"],
            ),
            job.output[0],
        ),
        log_path=job.log[0],
        slide_id=job.wildcards.slide_id,
    )


def draw_embedding_map(job: Any) -> None:
    from slidesnake.aggregate.embedding_map import draw_embedding_map

    run_job(
        lambda: draw_embedding_map(
            zarr_path=job.input.zarr,
            tiles_path=job.input.tiles,
            mask_path=job.input.mask,
            thumbnail_path=job.input.thumbnail,
            out_path=job.output[0],
        ),
        log_path=job.log[0],
        slide_id=job.wildcards.slide_id,
    )


def predict_tiles(job: Any) -> None:
    from slidesnake.aggregate.head import load_head, predict_slide, write_predictions
    from slidesnake.aggregate.heatmaps import draw_heatmaps
    from slidesnake.tiling.tile_table import read_tiles

    def predict() -> None:
        head = job.config["head"]
        loaded = load_head(head["checkpoint"], head["classes"], head["activation"])
        tiles, slide = predict_slide(loaded, job.input.zarr)
        write_predictions(tiles, slide, job.output.tiles, job.output.slide)
        _, geometry = read_tiles(job.input.tiles)
        draw_heatmaps(
            tiles,
            [column for column in tiles.columns if column not in ("x", "y")],
            geometry.size_level0,
            job.input.mask,
            job.input.thumbnail,
            job.output.heatmaps,
        )

    run_job(predict, log_path=job.log[0], slide_id=job.wildcards.slide_id)


JOBS = {
    f.__name__: f
    for f in (
        make_tissue_mask,
        make_tile_coords,
        embed_tiles,
        pool_slide,
        draw_embedding_map,
        predict_tiles,
    )
}

"""Snakemake script of rule embed_tiles: claim a GPU, then embed the slide's tiles."""

from slidesnake.gpu_slots import claim_gpu
from slidesnake.jobs import run_job

# Before torch is imported: CUDA must see only the claimed GPU.
claim_gpu(snakemake.params.gpu_ids)

from slidesnake.embed_settings import EmbedSettings  # noqa: E402
from slidesnake.embedding import embed_slide  # noqa: E402

run_job(
    lambda: embed_slide(
        slide_path=snakemake.input.slide,
        slide_id=snakemake.wildcards.slide_id,
        tiles_path=snakemake.input.tiles,
        zarr_path=snakemake.output.zarr,
        metrics_path=snakemake.output.metrics,
        settings=EmbedSettings.from_config(snakemake.params.settings),
    ),
    log_path=snakemake.log[0],
)

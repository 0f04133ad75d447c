"""Snakemake script of rule embed_tiles: claim a GPU and embed the slide's tiles, or, with
the remote backend, send them to the inference server."""

from slidesnake.cohort.jobs import run_job
from slidesnake.embed.gpu_slots import claim_gpu
from slidesnake.embed.settings import EmbedSettings


def embed() -> None:
    settings = EmbedSettings.from_config(snakemake.config)
    outputs = dict(
        slide_path=snakemake.params.slide,
        slide_id=snakemake.wildcards.slide_id,
        tiles_path=snakemake.input.tiles,
        zarr_path=snakemake.output.zarr,
        metrics_path=snakemake.output.metrics,
        settings=settings,
    )
    if settings.backend == "remote":
        from slidesnake.remote.loop import embed_slide_remote

        embed_slide_remote(**outputs)
        return
    gpu = snakemake.config["gpu"]
    claim_gpu(gpu["ids"], jobs_per_gpu=gpu["jobs_per_gpu"])
    # Imported after the claim: CUDA must start seeing only the claimed GPU.
    from slidesnake.embed.loop import embed_slide

    embed_slide(**outputs)


run_job(embed, log_path=snakemake.log[0], slide_id=snakemake.wildcards.slide_id)

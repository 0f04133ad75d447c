rule embed_tiles:
    input:
        slide=slide_path,
        tiles="results/{slide_id}/tiles.parquet",
    output:
        zarr=directory("results/{slide_id}/embeddings.zarr"),
        metrics=report(
            "results/{slide_id}/metrics.json",
            caption="../report/metrics.rst",
            category="Embedding metrics",
            labels={"slide": "{slide_id}"},
        ),
    log:
        "logs/{slide_id}/embed_tiles.log",
    conda:
        "../../envs/slidesnake.yaml"
    threads: config["loader"]["workers"] + 1
    resources:
        gpu=1,
        mem_mb=8000,
    params:
        settings=embed_settings(),
        gpu_ids=config["gpu"]["ids"],
    script:
        "../../scripts/embed_tiles.py"

rule embed_tiles:
    input:
        slide=slide_input,
        tiles="results/slides/{slide_id}/tiles.parquet",
    output:
        zarr=directory("results/slides/{slide_id}/embeddings.zarr"),
        metrics="results/slides/{slide_id}/metrics.json",
    log:
        "logs/slides/{slide_id}/embed_tiles.log",
    conda:
        "../../envs/slidesnake.yaml"
    threads: config["loader"]["workers"] + 1
    resources:
        gpu=1,
        mem_mb=8000,
    params:
        slide=slide_file,
        embedding=embedding_params(config),
    script:
        "../../scripts/embed_tiles.py"

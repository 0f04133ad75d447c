rule embed_tiles:
    input:
        **embedding_inputs(),
        slide=slide_input,
        tiles="results/slides/{slide_id}/tiles.parquet",
    output:
        **embedding_outputs(),
    log:
        "logs/slides/{slide_id}/embed_tiles.log",
    conda:
        "../../envs/slidesnake.yaml"
    threads: config["loader"]["workers"] + 1
    resources:
        # The remote backend's jobs are CPU clients of the server: they take an endpoint
        # slot (--resources endpoint=K), and a GPU only for the models that run here.
        gpu=1 if "local" in BACKENDS else 0,
        endpoint=1 if "remote" in BACKENDS else 0,
        storage_io=slide_storage_io,
        mem_mb=8000,
    params:
        **embedding_job_params(),
        slide=slide_file,
    script:
        "../../scripts/embed_tiles.py"

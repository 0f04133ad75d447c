rule pool_slide:
    input:
        zarr="results/slides/{slide_id}/embeddings.zarr",
        tiles="results/slides/{slide_id}/tiles.parquet",
        encoder=slide_encoder_input,
    output:
        "results/slides/{slide_id}/slide_features.parquet",
    log:
        "logs/slides/{slide_id}/pool_slide.log",
    group:
        slide_features_group
    conda:
        "../../envs/slidesnake.yaml"
    resources:
        mem_mb=2000,
        cpu_stage=1,
    params:
        slide=slide_params(config),
    script:
        "../../scripts/pool_slide.py"


rule draw_embedding_map:
    input:
        zarr="results/slides/{slide_id}/embeddings.zarr",
        tiles="results/slides/{slide_id}/tiles.parquet",
        mask="results/slides/{slide_id}/tissue_mask.png",
        thumbnail="results/slides/{slide_id}/qc_mask.png",
    output:
        "results/slides/{slide_id}/embedding_map.png",
    log:
        "logs/slides/{slide_id}/draw_embedding_map.log",
    group:
        slide_features_group
    conda:
        "../../envs/slidesnake.yaml"
    resources:
        mem_mb=2000,
        cpu_stage=1,
    script:
        "../../scripts/draw_embedding_map.py"


rule predict_tiles:
    input:
        zarr="results/slides/{slide_id}/embeddings.zarr",
        tiles="results/slides/{slide_id}/tiles.parquet",
        mask="results/slides/{slide_id}/tissue_mask.png",
        thumbnail="results/slides/{slide_id}/qc_mask.png",
        head=head_input,
    output:
        tiles="results/slides/{slide_id}/predictions.parquet",
        slide="results/slides/{slide_id}/slide_prediction.tsv",
        heatmaps="results/slides/{slide_id}/heatmaps.png",
    log:
        "logs/slides/{slide_id}/predict_tiles.log",
    group:
        slide_features_group
    conda:
        "../../envs/slidesnake.yaml"
    resources:
        mem_mb=2000,
        cpu_stage=1,
    params:
        head=head_params(config),
    script:
        "../../scripts/predict_tiles.py"

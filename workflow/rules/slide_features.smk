rule pool_slide:
    input:
        zarr=model_output("embeddings.zarr"),
        tiles="results/slides/{slide_id}/tiles.parquet",
        encoder=slide_encoder_input,
    output:
        model_output("slide_features.parquet"),
    log:
        model_log("pool_slide"),
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
        zarr=model_output("embeddings.zarr"),
        tiles="results/slides/{slide_id}/tiles.parquet",
        mask="results/slides/{slide_id}/tissue_mask.png",
        thumbnail="results/slides/{slide_id}/qc_mask.png",
    output:
        model_output("embedding_map.png"),
    log:
        model_log("draw_embedding_map"),
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
        zarr=model_output("embeddings.zarr"),
        tiles="results/slides/{slide_id}/tiles.parquet",
        mask="results/slides/{slide_id}/tissue_mask.png",
        thumbnail="results/slides/{slide_id}/qc_mask.png",
        head=head_input,
    output:
        tiles=model_output("predictions.parquet"),
        slide=model_output("slide_prediction.tsv"),
        heatmaps=model_output("heatmaps.png"),
    log:
        model_log("predict_tiles"),
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

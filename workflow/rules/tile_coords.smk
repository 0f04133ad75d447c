rule make_tile_coords:
    input:
        slide=slide_input,
        mask="results/slides/{slide_id}/tissue_mask.png",
        qc="results/slides/{slide_id}/qc_mask.png",
    output:
        tiles="results/slides/{slide_id}/tiles.parquet",
        qc=report(
            "results/slides/{slide_id}/qc_tiles.png",
            caption="../report/qc_tiles.rst",
            category="Tiles",
            labels={"slide": "{slide_id}"},
        ),
    log:
        "logs/slides/{slide_id}/make_tile_coords.log",
    conda:
        "../../envs/slidesnake.yaml"
    resources:
        mem_mb=1000,
    params:
        slide=slide_file,
        tiles=tile_params(config),
    script:
        "../../scripts/tile_coords.py"

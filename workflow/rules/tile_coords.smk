rule make_tile_coords:
    input:
        slide=slide_path,
        mask="results/{slide_id}/tissue_mask.png",
        qc="results/{slide_id}/qc_mask.png",
    output:
        tiles="results/{slide_id}/tiles.parquet",
        qc=report(
            "results/{slide_id}/qc_tiles.png",
            caption="../report/qc_tiles.rst",
            category="Tiles",
            labels={"slide": "{slide_id}"},
        ),
    log:
        "logs/{slide_id}/make_tile_coords.log",
    conda:
        "../../envs/slidesnake.yaml"
    resources:
        mem_mb=1000,
    params:
        tiles=config["tiles"],
    script:
        "../../scripts/tile_coords.py"

rule make_tissue_mask:
    input:
        slide=slide_path,
    output:
        mask="results/{slide_id}/tissue_mask.png",
        qc=report(
            "results/{slide_id}/qc_mask.png",
            caption="../report/qc_mask.rst",
            category="Tissue masks",
            labels={"slide": "{slide_id}"},
        ),
    log:
        "logs/{slide_id}/make_tissue_mask.log",
    conda:
        "../../envs/slidesnake.yaml"
    resources:
        mem_mb=2000,
    params:
        tissue=config["tissue"],
        mpp=sheet_mpp,
    script:
        "../../scripts/tissue_mask.py"

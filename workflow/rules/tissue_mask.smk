rule make_tissue_mask:
    input:
        slide=slide_input,
    output:
        mask="results/slides/{slide_id}/tissue_mask.png",
        qc=report(
            "results/slides/{slide_id}/qc_mask.png",
            caption="../report/qc_mask.rst",
            category="Tissue masks",
            labels={"slide": "{slide_id}"},
        ),
    log:
        "logs/slides/{slide_id}/make_tissue_mask.log",
    conda:
        "../../envs/slidesnake.yaml"
    resources:
        mem_mb=2000,
    params:
        slide=slide_file,
        identity=slide_identity,
        tissue=tissue_params(config),
        mpp=sheet_mpp,
    script:
        "../../scripts/tissue_mask.py"

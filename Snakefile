from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/tissue_mask.smk"
include: "workflow/rules/tile_coords.smk"
include: "workflow/rules/embed_tiles.smk"
include: "workflow/rules/cohort_summary.smk"


localrules:
    all,
    summarize_cohort,


onsuccess:
    summarize_cohort()


onerror:
    summarize_cohort()


rule all:
    default_target: True
    input:
        cohort_targets(),
        "results/cohort.html",

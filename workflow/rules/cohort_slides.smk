# Snakemake calls the handlers that write the cohort summary (cohort_summary.smk) only
# when it runs a job. So the list of the slides the summary describes is an output of its
# own, whose params are the sheet's slide ids: a new sheet (a slide removed, an emptied
# sheet), or a summary killed before its end (it deletes the list first and writes it
# last), gives the run a job, and the handler then writes the summary.


rule list_cohort_slides:
    output:
        f"results/{COHORT_SLIDES}",
    log:
        "logs/list_cohort_slides.log",
    conda:
        "../../envs/slidesnake.yaml"
    params:
        slides=list(samples.index),
    script:
        "../../scripts/list_cohort_slides.py"

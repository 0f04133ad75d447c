rule summarize_cohort:
    input:
        metrics=expand("results/slides/{slide_id}/metrics.json", slide_id=samples.index),
    output:
        report(
            "results/cohort.html",
            caption="../report/cohort.rst",
            category="Cohort",
        ),
    log:
        "logs/summarize_cohort.log",
    conda:
        "../../envs/slidesnake.yaml"
    params:
        slide_ids=list(samples.index),
    script:
        "../../scripts/summarize_cohort.py"

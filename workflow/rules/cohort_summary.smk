# The cohort summary is no rule: Snakemake skips every job downstream of a failed one, and
# the summary must say which slides failed. The onsuccess and onerror handlers write it.
# Snakemake calls neither when it has nothing to do: see cohort_slides.smk.

RUN_STARTED = time.time()
COHORT_FILES = {
    "results/cohort.html": "report/cohort.rst",
    "results/cohort_gallery.jpg": "report/gallery.rst",
    "results/embedding_maps.jpg": "report/embedding_maps.rst",
    "results/slide_features_pca.png": "report/slide_features_pca.rst",
}


def summarize_cohort():
    """results/cohort.tsv, cohort.html and cohort_gallery.jpg after every run, whether
    slides failed or not: what happened in this run, from the logs of its jobs, and what
    is on disk (or in the default storage) for the others."""
    with cohort_folder() as folder:
        table = write_cohort_summary(
            samples.index,
            folder / "results",
            folder / "logs" / "slides",
            RUN_STARTED,
            models=MODELS,
            head_model=config["head"]["model"] or "",
        )
    counts = table["status"].value_counts()
    logger.info(
        f"cohort{' (slides x models)' if MODELS else ''}: "
        + ", ".join(f"{counts.get(s, 0)} {s}" for s in ("done", "failed", "pending"))
        + " (results/cohort.tsv)"
    )


def cohort_folder():
    """The working directory, or a copy of what the summary reads from the outputs in
    storage (--default-storage-provider), stored back when the summary is written."""
    provider = workflow.storage_registry.default_storage_provider
    if provider is None:
        return contextlib.nullcontext(Path())
    prefix = workflow.storage_settings.default_storage_prefix.rstrip("/")
    return stored_cohort(provider, prefix)


def cohort_report():
    """The summary of the last run, for `snakemake --report`: inputs of rule all that no
    rule makes, listed once they exist. The report then carries the cohort table and one
    contact sheet whatever failed, and stays small however many slides there are."""
    return [
        cohort_file(path, caption)
        for path, caption in COHORT_FILES.items()
        if Path(path).is_file()
    ]


def cohort_file(path, caption):
    # A call of its own: Snakemake's parser takes a line that starts with `report` for
    # its `report:` keyword.
    return report(path, caption=caption, category="Cohort")

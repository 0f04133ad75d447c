import re

import pandas as pd
import yaml
from snakemake.exceptions import WorkflowError
from snakemake.logging import logger
from snakemake.utils import validate

from slidesnake.cohort.summary import write_cohort_summary
from slidesnake.cohort.config_overrides import typed_sections, with_defaults
from slidesnake.errors import SlidesnakeError
from slidesnake.models.registry import check_model_config
from slidesnake.cohort.samples import read_sample_sheet

with open(workflow.source_path("../../config/config.yaml")) as defaults:
    config.update(with_defaults(typed_sections(config), yaml.safe_load(defaults)))
validate(config, "../schemas/config.schema.yaml")

try:
    samples = read_sample_sheet(config["samples"])
except SlidesnakeError as err:
    raise WorkflowError(str(err)) from None
validate(samples, "../schemas/samples.schema.yaml")

try:
    check_model_config(config["model"], config["tiles"])
except SlidesnakeError as err:
    raise WorkflowError(str(err)) from None


wildcard_constraints:
    slide_id="|".join(re.escape(slide_id) for slide_id in samples.index),


def cohort_targets():
    """Every per-slide output the cohort needs."""
    return expand(
        "results/{slide_id}/{name}",
        slide_id=samples.index,
        name=["qc_tiles.png", "embeddings.zarr", "metrics.json"],
    )


def embed_settings():
    """The config sections the embedding job reads."""
    return {key: config[key] for key in ("model", "loader", "output", "embed")}


def slide_path(wildcards):
    return samples.loc[wildcards.slide_id, "path"]


def sheet_mpp(wildcards):
    """The sample sheet's mpp for this slide, or None to read it from the slide."""
    mpp = samples.loc[wildcards.slide_id, "mpp"]
    return None if pd.isna(mpp) else float(mpp)


def summarize_cohort():
    """results/cohort.tsv, after every run, whether slides failed or not."""
    table = write_cohort_summary(samples.index, "results", "logs", "results/cohort.tsv")
    counts = table["status"].value_counts()
    logger.info(
        "cohort: "
        + ", ".join(f"{counts.get(s, 0)} {s}" for s in ("done", "failed", "pending"))
        + " (results/cohort.tsv)"
    )

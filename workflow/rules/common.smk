import contextlib
import functools
import time
from pathlib import Path

import pandas as pd
import yaml
from snakemake.exceptions import WorkflowError
from snakemake.logging import logger
from snakemake.utils import validate

from slidesnake.cohort.config import (
    check_config,
    check_config_files,
    typed_sections,
    whole_numbers,
    with_defaults,
)
from slidesnake.cohort.decode_method import cohort_decode
from slidesnake.cohort.rule_params import (
    embedding_params,
    head_params,
    slide_params,
    tile_params,
    tissue_params,
    write_model_cards,
)
from slidesnake.cohort.run_checks import check_head_config, check_models_config
from slidesnake.cohort.samples import (
    SLIDE_ID_WILDCARD,
    read_sample_sheet,
    sheet_warnings,
)
from slidesnake.cohort.stored_summary import stored_cohort
from slidesnake.cohort.summary import (
    COHORT_SLIDES,
    failed_slides,
    write_cohort_summary,
)
from slidesnake.cluster.stuck_jobs import slide_log_report, watch_stuck_jobs
from slidesnake.embed.settings import model_configs
from slidesnake.errors import SlidesnakeError
from slidesnake.side_files import file_digest
from slidesnake.slides.locator import stat_slide, stat_slides
from slidesnake.slides.stores import configure as configure_storage, is_url


def load_yaml(path):
    with open(path) as f:
        return yaml.safe_load(f)


# What decides each model's embeddings, a file per model key (see write_model_cards).
MODEL_CARDS = "results/models"

try:
    defaults = load_yaml(workflow.source_path("../../config/config.yaml"))
    schema = load_yaml(workflow.source_path("../schemas/config.schema.yaml"))
    config.update(with_defaults(typed_sections(config, schema), defaults))
    check_config(config, schema)
    # Before any params are made and before any job reads them: 32.0 is 32.
    config.update(whole_numbers(config, schema))
    # Unset: the method of the embeddings already here, so that a cohort never mixes them.
    config["loader"]["decode"] = cohort_decode(
        config["loader"]["decode"], "results/slides"
    )
    configure_storage(config["storage"])
    # Checking a timm: architecture imports timm (6 s); the jobs that Snakemake starts
    # on cluster nodes parse this file again and need not repeat it.
    if workflow.is_main_process:
        check_config_files(config)
        check_models_config(config)
        check_head_config(config)
        write_model_cards(model_configs(config), MODEL_CARDS)
    samples = read_sample_sheet(config["samples"])
except SlidesnakeError as err:
    raise WorkflowError(str(err)) from None
validate(samples, "../schemas/samples.schema.yaml")
for warning in sheet_warnings(samples):
    logger.warning(f"sample sheet: {warning}")
MODELS = model_configs(config)
# Where the embedding jobs' models run: here, on an inference server, or both.
BACKENDS = {m["model"]["backend"] for m in (MODELS or {"": config}).values()}
# With several models, what a model decides lives in a folder per model key; with one
# model: it lives in the slide's folder, as it always has.
MODEL_DIR = "{model_key}/" if MODELS else ""


wildcard_constraints:
    slide_id=SLIDE_ID_WILDCARD,
    model_key="[A-Za-z0-9][A-Za-z0-9_-]*",


def model_output(name, key="{model_key}"):
    """The path of a per-slide output that a model decides."""
    if MODELS:
        return f"results/slides/{{slide_id}}/{key}/{name}"
    return f"results/slides/{{slide_id}}/{name}"


def model_log(rule):
    return f"logs/slides/{{slide_id}}/{MODEL_DIR}{rule}.log"


def embedding_outputs():
    """The embedding job's outputs: the store and metrics of each model. With several
    models they are flagged `update`: Snakemake then leaves in place (and restores, if
    the job fails) the outputs of the models the job finds current and does not redo.
    Not with a default storage provider, whose update outputs Snakemake 9 never fetches
    (it fails backing them up): there a job embeds every model of its list."""
    if not MODELS:
        return {
            "zarr": directory(model_output("embeddings.zarr")),
            "metrics": model_output("metrics.json"),
        }
    zarrs = [directory(model_output("embeddings.zarr", key)) for key in MODELS]
    metrics = [model_output("metrics.json", key) for key in MODELS]
    if workflow.storage_settings.default_storage_provider is None:
        zarrs, metrics = [update(p) for p in zarrs], [update(p) for p in metrics]
    return {"zarr": zarrs, "metrics": metrics}


def embedding_inputs():
    """With several models, the model cards: a changed or added card re-runs the jobs.
    They are written where Snakemake runs, not to a default storage provider."""
    return {"models": local(MODEL_CARDS)} if MODELS else {}


def embedding_job_params():
    """What decides the embeddings, for one model:. With several models the model cards
    (an input) say it, and the job itself skips the models whose outputs are current:
    params that listed the models would re-run every slide when one is removed."""
    return {} if MODELS else {"embedding": embedding_params(config)}


def cohort_targets():
    """Every per-slide output the cohort needs. Per-slide outputs and logs live under
    slides/, so that no slide id can name a cohort output (results/cohort.tsv) or log.
    """
    names = [
        "embeddings.zarr",
        "metrics.json",
        "slide_features.parquet",
        "embedding_map.png",
    ]
    heads = ["predictions.parquet", "slide_prediction.tsv", "heatmaps.png"]
    per_model = [(key, name) for key in MODELS or [""] for name in names]
    if config["head"]["checkpoint"]:
        per_model += [(config["head"]["model"] or "", name) for name in heads]
    paths = ["results/slides/{slide_id}/qc_tiles.png"]
    paths += [model_output(name, key) for key, name in per_model]
    targets = [
        path.format(slide_id=slide_id) for slide_id in samples.index for path in paths
    ]
    return [*targets, f"results/{COHORT_SLIDES}"]


# The input functions run several times per slide: plain dicts, not DataFrame.loc (100 µs
# a call, seconds per thousand slides).
SLIDE_PATHS = samples["path"].to_dict()
SLIDE_ROIS = samples["roi"].to_dict()
SLIDE_COORDS = samples["coords"].to_dict()
SHEET_MPP = {
    slide_id: None if pd.isna(mpp) else float(mpp)
    for slide_id, mpp in samples["mpp"].items()
}


def slide_file(wildcards):
    try:
        return SLIDE_PATHS[wildcards.slide_id]
    except KeyError:
        raise WorkflowError(
            f"slide '{wildcards.slide_id}' is not in the sample sheet {config['samples']}; "
            "add it there, or ask for the outputs of a slide that is"
        ) from None


def slide_input(wildcards):
    """The slide as an input when it is a local file that exists: a missing one fails its
    own job, not the DAG. A slide in a store is read in place, never an input file (no
    storage plugin downloads it); its identity is a param. A local slide stays local
    when outputs go to a default storage provider (--default-storage-provider)."""
    path = slide_file(wildcards)
    return local(path) if not is_url(path) and Path(path).exists() else []


def slide_storage_io(wildcards):
    """A slot of --resources storage_io=K, for the jobs that read a slide in a store."""
    return 1 if is_url(slide_file(wildcards)) else 0


@functools.cache
def slides_in_stores():
    """Size and version (ETag, generation) of every slide in a store: asked once per run
    for the whole sheet, storage.concurrency requests at a time (a job on a cluster node
    asks for its own slide only)."""
    return stat_slides(SLIDE_PATHS.values()) if workflow.is_main_process else {}


def slide_identity(wildcards):
    """Size and modification time of the slide file (in a store: its size and version),
    for the mask rule's params: a file replaced by another re-runs the slide even when
    its mtime is older than the outputs (cp -p, a restore from backup), which Snakemake's
    mtime trigger misses. A stat, not a hash: it costs nothing per slide however large
    the cohort."""
    path = slide_file(wildcards)
    if is_url(path):
        return slides_in_stores().get(path) or stat_slides([path])[path]
    try:
        return stat_slide(path, wildcards.slide_id).describe()
    except OSError:
        return "missing"


def tiling_inputs(wildcards):
    """The slide's regions and imported coordinates, where it has files that exist: a
    changed file re-runs its tiling; a missing one fails the slide's own job, not the DAG.
    """
    paths = [SLIDE_ROIS[wildcards.slide_id], SLIDE_COORDS[wildcards.slide_id]]
    return [path for path in paths if path and Path(path).exists()]


TILE_PARAMS = tile_params(config)


def slide_tile_params(wildcards):
    """tiles.* and the slide's regions (with roi.*) and imported coordinates where it has
    them, each with its file's digest: a file replaced by another re-runs the slide's
    tiling even when its mtime is older than the outputs. A slide with neither keeps the
    params it always had."""
    params = dict(TILE_PARAMS)
    roi, coords = SLIDE_ROIS[wildcards.slide_id], SLIDE_COORDS[wildcards.slide_id]
    if roi:
        params |= {"roi": roi, "roi_classes": config["roi"]}
        params["roi_sha256"] = side_file_digest(roi)
    if coords:
        params |= {"coords": coords, "coords_sha256": side_file_digest(coords)}
    return params


@functools.cache
def side_file_digest(path):
    """Once per run and file: the params functions run several times per job."""
    return file_digest(path)


def sheet_mpp(wildcards):
    """The sample sheet's mpp for this slide, or None to read it from the slide."""
    return SHEET_MPP[wildcards.slide_id]


# A SLURM group job fails as a whole when one of its jobs fails, and Snakemake then deletes
# the outputs of all of them. A slide that failed in the last run gets a submission of its
# own, so a bad slide costs its batch at most one run, not every run until it is fixed.
FAILED_LAST_RUN = failed_slides("results/cohort.tsv")


def cpu_stages_group(wildcards):
    """The group that batches the CPU stages of many slides in one SLURM submission
    (the profile's group-components), or none for a slide that failed last time."""
    return None if wildcards.slide_id in FAILED_LAST_RUN else "cpu_stages"


def slide_features_group(wildcards):
    """As cpu_stages_group, for the stages after the embedding (pooling, the map)."""
    return None if wildcards.slide_id in FAILED_LAST_RUN else "slide_features"


def head_input(wildcards):
    """The head's file, an input when there is one: replacing it re-runs the predictions."""
    return config["head"]["checkpoint"] or []


def slide_encoder_input(wildcards):
    """The slide encoder program, an input when there is one: replacing it re-runs pooling."""
    return config["slide"]["encoder"] or []


def watch_slurm_jobs():
    """Under SLURM, report and cancel the run's jobs that can never start, instead of
    waiting for them forever."""
    plugin = workflow.executor_plugin
    if plugin is None or plugin.name != "slurm":
        return
    interval = config["slurm"]["check_pending_s"]
    reporter = slide_log_report(SLIDE_PATHS, logger.error)
    watch_stuck_jobs(Path.cwd(), interval, reporter, logger.warning)

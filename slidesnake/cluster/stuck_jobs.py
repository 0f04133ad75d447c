"""SLURM jobs that can never start, found while the run waits for them.

A job that asks for more CPUs, memory or GPUs than any node of its partition has stays
pending forever (reason `PartitionConfig` or `Resources`), and Snakemake waits with it,
silently. The main process looks at its own pending jobs every few minutes, and reports and
cancels those that fit on no node, with the setting to change; the job then fails like any
other, so the rest of the cohort goes on.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from slidesnake.errors import ClusterQueryError

# Reasons that no amount of waiting clears: the partition's own limits.
PARTITION_LIMITS = {"PartitionTimeLimit", "PartitionNodeLimit"}
QUEUE_FIELDS = [
    "JobID", "ArrayJobID", "ArrayTaskID", "Partition", "Reason", "tres-alloc", "Comment", "WorkDir",
]  # fmt: skip


@dataclass(frozen=True)
class Request:
    """CPUs, memory and GPUs: what a job asks for, or what a node has."""

    cpus: int = 0
    mem_mb: int = 0
    gpus: int = 0

    def fits_in(self, node: Request) -> bool:
        return self.cpus <= node.cpus and self.mem_mb <= node.mem_mb and self.gpus <= node.gpus


@dataclass(frozen=True)
class PendingJob:
    job_id: str  # an array's element: <array>_<element>
    partition: str
    reason: str
    request: Request
    rule: str
    slide_id: str | None  # a per-slide job's (the workflow's one wildcard); None: a group


def from_comment(comment: str) -> tuple[str, str | None]:
    """The rule and the slide in the SLURM plugin's comment, 'rule_<rule>_wildcards_<values>'
    (a group's: 'rule_<group>_<rules>', no slide). An array's names its first slide only."""
    rule, _, slide = comment.removeprefix("rule_").partition("_wildcards_")
    return rule, slide or None


def array_slides(array_id: str) -> dict[str, str]:
    """Each element of an array (by its task id) -> its slide, from the submission's
    script (sbatch's stdin, or its --wrap): the SLURM plugin (2.6 on) runs the first
    element's job as the script's command, and gives each other element its own in the
    script's --slurm-jobstep-array-execs (base64 of JSON, element -> zlib-compressed)."""
    script = _slurm(["scontrol", "write", "batch_script", array_id, "-"])
    payload = re.search(r"--slurm-jobstep-array-execs[=\s]+'?([A-Za-z0-9+/=]+)", script)
    execs = json.loads(base64.b64decode(payload.group(1))) if payload else {}
    commands = {task: zlib.decompress(bytes.fromhex(code)).decode() for task, code in execs.items()}
    first = min(map(int, execs), default=2) - 1  # the script's own element
    commands[str(first)] = script
    return {task: found.group(1) for task, command in commands.items()
            if (found := _TARGET_SLIDE.search(command))}  # fmt: skip


# How a job's command names its slide: --target-jobs '<rule>:slide_id=<id>'.
_TARGET_SLIDE = re.compile(r"slide_id=([^\s',\"]+)")


def parse_tres(tres: str) -> Request:
    """'cpu=5,mem=16000M,node=1,gres/gpu=1' (SLURM's trackable resources) as a Request."""
    values = dict(item.split("=", 1) for item in tres.split(",") if "=" in item)
    return Request(
        cpus=int(values.get("cpu", 0)),
        mem_mb=_megabytes(values.get("mem", "0")),
        gpus=int(values.get("gres/gpu", 0)),
    )


def _megabytes(size: str) -> int:
    units = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
    if size and size[-1] in units:
        return int(float(size[:-1]) * units[size[-1]])
    return int(size)


def pending_jobs(workdir: Path) -> list[PendingJob]:
    """This user's pending jobs that were submitted from `workdir` (this run's), an
    array's elements each on its own."""
    columns = ",".join(f"{field}:|" for field in QUEUE_FIELDS)
    command = ["squeue", "--me", "--noheader", "--array", "--states=PENDING", "-O", columns]
    jobs, arrays = [], {}
    for line in _slurm(command).splitlines():
        job_id, array_id, task, partition, reason, tres, comment, job_dir, *_ = line.split("|")
        if Path(job_dir) != workdir or not comment.startswith("rule_"):
            continue
        rule, slide = from_comment(comment)
        if task.strip() not in ("", "N/A"):
            if array_id not in arrays:
                arrays[array_id] = array_slides(array_id)
            slide, job_id = arrays[array_id].get(task.strip()), f"{array_id}_{task.strip()}"
        jobs.append(PendingJob(job_id, partition, reason, parse_tres(tres), rule, slide))
    return jobs


def node_sizes() -> dict[str, list[Request]]:
    """Partition -> what each of its nodes has (configured, not what is free now)."""
    sizes: dict[str, list[Request]] = {}
    for line in _slurm(["scontrol", "--oneliner", "show", "node"]).splitlines():
        tres = re.search(r"\bCfgTRES=(\S*)", line)
        partitions = re.search(r"\bPartitions=(\S*)", line)
        if tres and partitions:
            for partition in partitions.group(1).split(","):
                sizes.setdefault(partition, []).append(parse_tres(tres.group(1)))
    return sizes


def never_starts(job: PendingJob, sizes: dict[str, list[Request]]) -> bool:
    if job.reason in PARTITION_LIMITS:
        return True
    return not any(job.request.fits_in(node) for node in sizes.get(job.partition, []))


def why_never(job: PendingJob, sizes: dict[str, list[Request]]) -> str:
    """One line: the job, what it asks for that no node has, and the setting to change."""
    nodes = sizes.get(job.partition, [])
    largest = Request(
        cpus=max((node.cpus for node in nodes), default=0),
        mem_mb=max((node.mem_mb for node in nodes), default=0),
        gpus=max((node.gpus for node in nodes), default=0),
    )
    slide = f", slide '{job.slide_id}'" if job.slide_id else ""
    fixes = list(_fixes(job, largest)) or [
        f"the partition's limits forbid it: give {job.rule} another partition "
        f"(--set-resources {job.rule}:slurm_partition=...) or a shorter runtime"
    ]
    return (
        f"SLURM job {job.job_id} ({job.rule}{slide}) can never start in partition "
        f"'{job.partition}' (pending: {job.reason}): {'; '.join(fixes)}. It was cancelled."
    )


def _fixes(job: PendingJob, largest: Request) -> Iterable[str]:
    asked = job.request
    if asked.cpus > largest.cpus:
        if job.rule == "embed_tiles":
            setting = "lower loader.workers (the job takes loader.workers + 1 CPUs)"
        else:  # a group of CPU stages: its jobs that run at once
            setting = "lower cpu_stage in the profile's `resources:`"
        yield f"it asks for {asked.cpus} CPUs, the largest node has {largest.cpus}: {setting}"
    if asked.mem_mb > largest.mem_mb:
        yield (
            f"it asks for {asked.mem_mb} MB, the largest node has {largest.mem_mb} MB: lower "
            f"mem_mb for {job.rule} in the profile's set-resources"
        )
    if asked.gpus > largest.gpus:
        yield (
            f"it asks for {asked.gpus} GPU, the nodes have {largest.gpus}: put it on a GPU "
            f"partition (--set-resources {job.rule}:slurm_partition=...)"
        )


def _slurm(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ClusterQueryError(f"`{' '.join(command)}` did not answer: {err}") from err
    if done.returncode != 0:
        raise ClusterQueryError(f"`{' '.join(command)}` failed: {done.stderr.strip()}")
    return done.stdout


def cancel_stuck_jobs(workdir: Path, report: Callable[[PendingJob, str], None]) -> int:
    """Report and cancel this run's jobs that can never start; how many there were."""
    jobs = pending_jobs(workdir)
    if not jobs:
        return 0
    sizes = node_sizes()
    stuck = [job for job in jobs if never_starts(job, sizes)]
    for job in stuck:
        report(job, why_never(job, sizes))
        _slurm(["scancel", job.job_id])
    return len(stuck)


def slide_log_report(
    slide_ids: Iterable[str], error: Callable[[str], None], logs: Path = Path("logs/slides")
) -> Callable[[PendingJob, str], None]:
    """A `report` for `watch_stuck_jobs`: `error(message)`, and for a job of one of the
    cohort's slides the same line in that job's log, where the cohort summary finds it."""
    known = set(slide_ids)

    def report(job: PendingJob, message: str) -> None:
        error(message)
        if job.slide_id in known:
            log = logs / job.slide_id / f"{job.rule}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            stamp = time.strftime("%Y-%m-%d %H:%M:%S,000")
            with log.open("a") as file:
                file.write(f"{stamp} ERROR slidesnake.cluster: {message}\n")

    return report


def watch_stuck_jobs(
    workdir: Path,
    interval_s: float,
    report: Callable[[PendingJob, str], None],
    warn: Callable[[str], None],
) -> threading.Thread:
    """Check every `interval_s` seconds, in a daemon thread that ends with the run."""

    def loop() -> None:
        while True:
            time.sleep(interval_s)
            try:
                cancel_stuck_jobs(workdir, report)
            except ClusterQueryError as err:
                warn(f"could not look for SLURM jobs that never start: {err}")

    thread = threading.Thread(target=loop, name="slurm-stuck-jobs", daemon=True)
    thread.start()
    return thread

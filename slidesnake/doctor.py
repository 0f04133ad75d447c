"""`slidesnake doctor`: what a run will need, checked before it starts, one line each.

Each check returns `Finding`s: OK, NOTE (worth knowing, not a fault: no GPU on a laptop)
or FAIL with the fix. The checks read what the workflow would: the same config with the
workflow's defaults, the same sample sheet, the same weights loader.
"""

from __future__ import annotations

import importlib
import math
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import yaml
from packaging.requirements import Requirement

from slidesnake.cohort.config import load_config
from slidesnake.cohort.samples import read_sample_sheet
from slidesnake.errors import SlidesnakeError, StoreTimeoutError
from slidesnake.models.checkpoints import HUB_FILES, is_program
from slidesnake.models.pt2_archive import check_archive
from slidesnake.models.registry import (
    check_model_config,
    model_input,
    model_spec,
    weights_source,
)
from slidesnake.models.weight_files import weights_problem
from slidesnake.slides import stores
from slidesnake.slides.slide import Slide

Status = Literal["OK", "NOTE", "FAIL"]
MIN_PYTHON = (3, 11)
# What a slide writes besides its embeddings: masks, QC pictures, tables, map, metrics.
PICTURES_BYTES = 3 << 20
# The share of a slide's area under tissue, for the disk estimate: a slide is not tiled
# before the run, and H&E sections cover a third to a half of the scan.
TISSUE_SHARE = 0.5
# The width the disk estimate takes for a model whose width is known only once it runs.
LARGEST_WIDTH = 2560
SERVER_WAIT_S = 10.0
# The SLURM executor plugin's wait for `scontrol show config` at every Snakemake start.
PLUGIN_WAIT_S = 10.0
PLUGIN_FIX = (
    "Fix: where this machine does not submit to SLURM, uninstall the plugin "
    "(pip uninstall snakemake-executor-plugin-slurm; it is the extra slidesnake[slurm])"
)


@dataclass(frozen=True)
class Finding:
    status: Status
    check: str
    message: str

    def line(self) -> str:
        return f"{self.status:<5} {self.check}: {self.message}"


def python_check(version: tuple[int, ...] = sys.version_info[:3]) -> list[Finding]:
    shown = ".".join(map(str, version))
    if tuple(version[:2]) < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        return [Finding("FAIL", "python", f"Python {shown}; slidesnake needs {need} or later")]
    return [Finding("OK", "python", f"Python {shown} ({sys.executable})")]


def packages_check(requirements: Iterable[str] | None = None) -> list[Finding]:
    """Each dependency installed and inside the range pyproject.toml gives."""
    if requirements is None:
        requirements = [r for r in metadata.requires("slidesnake") or [] if "extra ==" not in r]
    found, problems = [], []
    for text in requirements:
        requirement = Requirement(text)
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{requirement.name} is not installed")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{requirement.name} {version} is outside {requirement.specifier}")
        found.append(f"{requirement.name} {version}")
    if problems:
        fix = "pip install -e . (or make install) in the environment the jobs run in"
        return [Finding("FAIL", "packages", f"{'; '.join(problems)}; {fix}")]
    return [
        Finding(
            "OK",
            "packages",
            f"slidesnake {metadata.version('slidesnake')}; {len(found)} dependencies in range",
        )
    ]


def torch_check() -> list[Finding]:
    """torch, its CUDA build, and each visible GPU with fp16 and bf16 tried on it."""
    import torch

    cuda = torch.version.cuda or "none (a CPU build)"
    findings = [Finding("OK", "torch", f"torch {torch.__version__}, CUDA build {cuda}")]
    if not torch.cuda.is_available():
        return [
            *findings,
            Finding(
                "NOTE",
                "gpu",
                "no GPU visible: embedding runs on the CPU, "
                "fine for tests and demos, far too slow for a cohort",
            ),
        ]
    return findings + [_gpu_finding(index) for index in range(torch.cuda.device_count())]


def _gpu_finding(index: int) -> Finding:
    import torch

    props = torch.cuda.get_device_properties(index)
    failed = [
        name
        for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16))
        if not _matmul_works(index, dtype)
    ]
    what = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, driver {_driver()}"
    if failed:
        return Finding(
            "FAIL",
            f"gpu {index}",
            f"{what}: {' and '.join(failed)} give wrong "
            "results; set model.precision: fp32, or check the driver",
        )
    return Finding("OK", f"gpu {index}", f"{what}; fp16 and bf16 work")


def _matmul_works(index: int, dtype: Any) -> bool:
    import torch

    a = torch.randn(64, 64, device=f"cuda:{index}")
    try:
        low = (a.to(dtype) @ a.to(dtype)).float()
    except RuntimeError:
        return False
    return bool(torch.allclose(low, a @ a, rtol=0.05, atol=0.5))


def _driver() -> str:
    try:
        answer = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return answer.stdout.splitlines()[0].strip() if answer.stdout.strip() else "unknown"


def openslide_check(module: str = "openslide") -> list[Finding]:
    try:
        openslide = importlib.import_module(module)
        version = openslide.__library_version__
    except (ImportError, OSError, AttributeError) as err:
        return [
            Finding(
                "FAIL",
                "openslide",
                f"the OpenSlide library cannot be loaded ({err}); pip install openslide-bin",
            )
        ]
    return [Finding("OK", "openslide", f"OpenSlide {version}")]


def snakemake_check(slurm: bool, sinfo: str = "sinfo") -> list[Finding]:
    """Snakemake and its executor plugins, and what the SLURM plugin costs each start; with
    the SLURM profile, the cluster's answer."""
    executors = sorted(
        d.metadata["Name"].removeprefix("snakemake-executor-plugin-")
        for d in metadata.distributions()
        if d.metadata["Name"].startswith("snakemake-executor-plugin-")
    )
    shown = ", ".join(executors) or "none besides local"
    findings = [
        Finding("OK", "snakemake", f"Snakemake {metadata.version('snakemake')}; executors: {shown}")
    ]
    if "slurm" in executors:
        findings += slurm_plugin_check()
    if not slurm:
        return findings
    if "slurm" not in executors:
        return [
            *findings,
            Finding(
                "FAIL", "slurm", "the SLURM profile needs its executor: pip install -e '.[slurm]'"
            ),
        ]
    return [*findings, _slurm_finding(sinfo)]


def slurm_plugin_check(path: str | None = None) -> list[Finding]:
    """What the SLURM executor plugin does at every Snakemake start, a local run's too,
    where SLURM's clients are installed (`path`: where to look for them, else PATH): it
    refuses to start where `sinfo` is found without `sacct` or `squeue`, and it asks the
    controller for its config (`scontrol show config`, up to 10 s) before anything runs."""
    found = {tool: shutil.which(tool, path=path) for tool in ("sinfo", "sacct", "squeue")}
    if found["sinfo"] is None:
        return []
    if found["sacct"] is None and found["squeue"] is None:
        return [Finding("FAIL", "slurm-plugin", (
            f"{found['sinfo']} is installed without sacct or squeue, and the SLURM executor "
            f"plugin then stops every Snakemake start, a local one's too. {PLUGIN_FIX}, or "
            "install SLURM's client commands in full"
        ))]  # fmt: skip
    scontrol = shutil.which("scontrol", path=path) or "scontrol"
    started = time.perf_counter()
    try:
        answer = subprocess.run(
            [scontrol, "show", "config"], capture_output=True, text=True, timeout=PLUGIN_WAIT_S
        )
        said = (answer.stderr.strip().splitlines() or ["no message"])[-1]
        answered = answer.returncode == 0
    except (OSError, subprocess.TimeoutExpired) as err:
        said, answered = str(err), False
    waited = time.perf_counter() - started
    if answered:
        return [Finding("OK", "slurm-plugin", f"the SLURM controller answers in {waited:.1f} s")]
    return [Finding("NOTE", "slurm-plugin", (
        f"SLURM's clients are installed and no controller answers ({said}): every Snakemake "
        f"start, a local one's too, waits {waited:.1f} s for it here (up to "
        f"{PLUGIN_WAIT_S:g} s). {PLUGIN_FIX}, or start slurmctld or set SLURM_CONF to a "
        "cluster that answers"
    ))]  # fmt: skip


def _slurm_finding(sinfo: str) -> Finding:
    try:
        answer = subprocess.run(
            [sinfo, "--noheader", "--format=%P %a %D"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return Finding(
            "FAIL",
            "slurm",
            f"sinfo did not answer ({err}); run where SLURM "
            "commands work, or leave out --profile profiles/slurm",
        )
    if answer.returncode != 0:
        said = (answer.stderr.strip().splitlines() or ["no message"])[-1]
        return Finding(
            "FAIL",
            "slurm",
            f"SLURM does not answer ({said}); check that "
            "slurmctld is up (scontrol ping), or leave out the SLURM profile",
        )
    partitions = ", ".join(line.split()[0] for line in answer.stdout.splitlines() if line.strip())
    return Finding("OK", "slurm", f"partitions: {partitions or 'none'}")


def run_checks(checks: dict[str, Callable[[], list[Finding]]]) -> list[Finding]:
    """Every check, each on its own: one that raises becomes its FAIL line, and the
    next check still runs."""
    findings = []
    for name, check in checks.items():
        try:
            findings.extend(check())
        except SlidesnakeError as err:
            findings.append(Finding("FAIL", name, str(err)))
        except Exception as err:  # a check that breaks must not hide the checks after it
            said = str(err).splitlines()[0] if str(err) else "no message"
            findings.append(Finding("FAIL", name, f"unexpected {type(err).__name__}: {said}"))
    return findings


def run_doctor(configfiles: list[Path], slurm: bool) -> list[Finding]:
    """All checks: the machine's, then the run's (config, weights, slides, disk)."""
    findings = run_checks({
        "python": python_check,
        "packages": packages_check,
        "torch": torch_check,
        "openslide": openslide_check,
        "snakemake": lambda: snakemake_check(slurm),
    })  # fmt: skip
    try:
        config = load_config(configfiles)
    except (SlidesnakeError, OSError, yaml.YAMLError) as err:
        return [*findings, Finding("FAIL", "config", f"{err}; fix the config")]
    shown = ", ".join(map(str, configfiles)) or "the workflow's defaults"
    findings.append(Finding("OK", "config", f"{shown}: valid"))
    return findings + run_checks({
        "weights": lambda: weights_check(config),
        "decode": lambda: decode_check(config),
        "slides": lambda: slides_check(config),
    })  # fmt: skip


def decode_check(config: dict[str, Any], module: str = "nvidia.nvimgcodec") -> list[Finding]:
    """With loader.decode gpu: whether nvImageCodec is there, and a GPU for it."""
    if (config.get("loader") or {}).get("decode") != "gpu":
        return []
    try:
        version = importlib.import_module(module).__version__
    except ImportError:
        fix = "pip install 'slidesnake[gpu-decode]', or set loader.decode to exact or scaled"
        return [Finding("FAIL", "decode", f"loader.decode gpu needs nvImageCodec; {fix}")]
    import torch

    if not torch.cuda.is_available():
        where = "the job decodes on the CPU in its main process, slower than exact"
        return [Finding("NOTE", "decode", f"nvImageCodec {version}, but no CUDA GPU here: {where}")]
    return [Finding("OK", "decode", f"nvImageCodec {version}: JPEG tiles decode on the GPU")]


def weights_check(config: dict[str, Any]) -> list[Finding]:
    """The configured model's weights as a job will load them, or its server's answer;
    with `models:`, each model's, its key in the line."""
    from slidesnake.embed.settings import model_configs

    models = model_configs(config)
    if not models:
        return [_model_finding(config, None)]
    findings = []
    for key, model_config in models.items():
        findings += run_checks(
            {f"weights {key}": lambda c=model_config, k=key: [_model_finding(c, k)]}
        )
    return findings


def _model_finding(config: dict[str, Any], key: str | None) -> Finding:
    """One model's weights, or its server; `key`: its key in `models:`, if it has one."""
    model, name = config["model"], "weights" if key is None else f"weights {key}"
    if model["backend"] == "remote":
        return _server_finding(config)
    check_model_config(model, config["tiles"], config["remote"], key)
    spec = model_spec(model["name"], model["mean"], model["std"])
    tiles = config["tiles"]
    size = model_input(
        spec, tiles["size"], tiles["mpp"], model.get("input_size"), model.get("input_mpp")
    ).size
    source = weights_source(spec, model["weights"], model["checkpoint"])
    if source is None:
        return Finding(
            "NOTE",
            name,
            f"model '{spec.name}' has random weights: its "
            "embeddings mean nothing (demos and tests only)",
        )
    if source.startswith("hf-hub:"):
        return _hub_cache_finding(source)
    path = Path(source)
    if is_program(path):
        if path.suffix == ".pt2":
            check_archive(path)
        return Finding("OK", name, f"{path}: a program, checked as plain data")
    problem = weights_problem(spec, path, size)
    if problem is not None:
        return Finding("FAIL", name, problem)
    return Finding("OK", name, f"{path} loads as weights only and fits '{spec.name}'")


def _hub_cache_finding(source: str) -> Finding:
    from huggingface_hub import try_to_load_from_cache

    repo = source.removeprefix("hf-hub:")
    for filename in HUB_FILES:
        cached = try_to_load_from_cache(repo, filename)
        if isinstance(cached, str):
            return Finding("OK", "weights", f"{source} is in the Hugging Face cache ({cached})")
    return Finding(
        "FAIL",
        "weights",
        f"{source} is not in the Hugging Face cache here; a job "
        "on a machine without internet fails: run `slidesnake weights fetch` and "
        "set model.checkpoint",
    )


def _server_finding(config: dict[str, Any]) -> Finding:
    from slidesnake.embed.settings import EmbedSettings
    from slidesnake.remote.client import InferenceClient

    remote = EmbedSettings.from_config(config).remote
    wait_s = min(remote.ready_timeout_s, SERVER_WAIT_S)
    urls = [remote.url] if isinstance(remote.url, str) else list(remote.url)
    for url in urls:
        client = InferenceClient(remote, url)
        try:
            client.wait_ready(wait_s, "doctor's wait")
        finally:
            client.close()
    return Finding("OK", "server", f"model '{remote.model}' ready on {', '.join(urls)}")


def slides_check(config: dict[str, Any]) -> list[Finding]:
    """Every slide of the sheet opens, with a resolution: the disk estimate needs both."""
    sheet = read_sample_sheet(config["samples"])
    stores.configure(config.get("storage"))  # slides in buckets: opened as the jobs will
    problems, sizes = [], []
    silent: set[str] = set()  # hosts that let a question go unanswered: not asked again
    for slide_id, row in sheet.iterrows():
        mpp = None if math.isnan(row["mpp"]) else row["mpp"]
        host = stores.host(row["path"])
        if host and host in silent:
            problems.append(f"slide '{slide_id}': its store {host} did not answer (above)")
            continue
        try:
            with Slide(row["path"], slide_id, mpp) as slide:  # a cohort's worth of files
                sizes.append((slide.dimensions, slide.mpp))
        except StoreTimeoutError as err:
            silent.add(host)
            problems.append(str(err))
        except SlidesnakeError as err:
            problems.append(str(err))
    if problems:
        shown = "; ".join(problems[:3]) + (
            f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        )
        return [
            Finding(
                "FAIL", "slides", f"{len(problems)} of {len(sheet)} slides cannot be read: {shown}"
            )
        ]
    findings = [Finding("OK", "slides", f"all {len(sheet)} slides of {config['samples']} open")]
    return findings + disk_check(config, sizes)


def disk_check(config: dict[str, Any], sizes: list, free: int | None = None) -> list[Finding]:
    """Free space under results/ against what the cohort will write: embeddings of the
    tiles under tissue (taken as half of each slide), and the pictures and tables."""
    model = config["model"]
    width = model_spec(model["name"], model["mean"], model["std"]).dim or LARGEST_WIDTH
    needed = sum(_slide_bytes(config, width, dimensions, mpp) for dimensions, mpp in sizes)
    results = Path("results")
    free = free_bytes(results) if free is None else free
    shown = f"the cohort needs about {needed / 1e9:.2f} GB, {results}/ has {free / 1e9:.1f} GB free"
    if needed > free:
        return [Finding("FAIL", "disk", f"{shown}; free space or run from another disk")]
    return [Finding("OK", "disk", shown)]


def _slide_bytes(
    config: dict[str, Any], width: int, dimensions: tuple[int, int], mpp: float
) -> float:
    tiles = config["tiles"]
    stride_um = (tiles["stride"] or tiles["size"]) * tiles["mpp"]
    area_um2 = dimensions[0] * dimensions[1] * mpp * mpp
    count = TISSUE_SHARE * area_um2 / stride_um**2
    value_bytes = 2 if config["output"]["dtype"] == "float16" else 4
    return count * (width * value_bytes + 16) + PICTURES_BYTES


def free_bytes(directory: Path) -> int:
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    return shutil.disk_usage(existing).free

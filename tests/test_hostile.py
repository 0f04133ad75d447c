"""Hostile inputs: files and settings written to break a run, each a member of a class.

Checkpoints: every format a user can point `model.checkpoint` at, made to run code (a
payload that would create a marker file). For the .pt2 members that torch itself would
run, a first test proves the attack is real: unchecked, torch runs the payload.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import REPO, jobs_run, write_sheet
from test_models import PT2, export, tiny_vit

from slidesnake import load_embeddings
from slidesnake.cohort.config import check_config
from slidesnake.cohort.samples import read_sample_sheet, sheet_warnings
from slidesnake.cohort.summary import failure_in_run
from slidesnake.errors import (
    ConfigError,
    EmbeddingsError,
    ModelError,
    SampleSheetError,
    SlideSizeError,
)
from slidesnake.models.embedder import build_embedder
from slidesnake.models.pt2_archive import ARCHIVE_TORCH
from slidesnake.models.registry import check_model_config, model_spec
from slidesnake.slides.synthetic import Rect, write_slide
from slidesnake.tiling.stages import make_tissue_mask
from slidesnake.tiling.tissue import TissueParams

CPU = torch.device("cpu")


class Payload:
    """Unpickled, it creates `marker`: what any code from the file could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def pickled(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    return buffer.getvalue()


def touch_code(marker: Path) -> str:
    return f"__import__('pathlib').Path({str(marker)!r}).touch()"


# --- .pt2: a real export, then one entry of it made hostile --------------------------


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    if torch.__version__ < ARCHIVE_TORCH:
        pytest.skip(f"a .pt2 archive needs torch {ARCHIVE_TORCH}")
    path = tmp_path_factory.mktemp("program") / "program.pt2"
    torch.export.save(export(tiny_vit()), str(path))
    return path


def rewrite(source: Path, target: Path, edit: Callable[[dict[str, bytes]], None]) -> Path:
    """Copy a .pt2 archive with `edit` applied to its records (names without the root)."""
    with zipfile.ZipFile(source) as archive:
        root = archive.namelist()[0].split("/")[0]
        records = {name.split("/", 1)[1]: archive.read(name) for name in archive.namelist()}
    edit(records)
    with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as archive:
        for name, data in records.items():
            archive.writestr(f"{root}/{name}", data)
    return target


def edit_json(records: dict[str, bytes], name: str, edit: Callable[[dict], None]) -> None:
    document = json.loads(records[name])
    edit(document)
    records[name] = json.dumps(document).encode()


def pickled_weight(records: dict[str, bytes], marker: Path) -> None:
    config = "data/weights/model_weights_config.json"
    edit_json(records, config, lambda c: c["config"]["cls_token"].update(use_pickle=True))
    path = json.loads(records[config])["config"]["cls_token"]["path_name"]
    records[f"data/weights/{path}"] = pickled(marker)


def pickled_constant(records: dict[str, bytes], marker: Path) -> None:
    entry = {"path_name": "tensor_0", "is_param": False, "use_pickle": True, "tensor_meta": None}
    config = "data/constants/model_constants_config.json"
    edit_json(records, config, lambda c: c["config"].update(c0=entry))
    records["data/constants/tensor_0"] = pickled(marker)


def opaque_constant(records: dict[str, bytes], marker: Path) -> None:
    entry = {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True}
    config = "data/constants/model_constants_config.json"
    edit_json(records, config, lambda c: c["config"].update(c0=entry))
    records["data/constants/opaque_obj_0"] = pickle.dumps(Payload(marker))


def pickled_example_inputs(records: dict[str, bytes], marker: Path) -> None:
    # torch retries example inputs that fail weights_only with weights_only=False.
    records["data/sample_inputs/model.pt"] = pickled(marker)


def legacy_weights(records: dict[str, bytes], marker: Path) -> None:
    records["data/weights/model.pt"] = pickled(marker)


def native_library(records: dict[str, bytes], marker: Path) -> None:
    records["data/aotinductor/model/model.so"] = b"\x7fELF"


def shape_expression(records: dict[str, bytes], marker: Path) -> None:
    # sympy's Max sympifies (evals) a string argument.
    def edit(program: dict) -> None:
        sizes = program["graph_module"]["graph"]["tensor_values"]["x"]["sizes"]
        symbol = sizes[0]["as_expr"]["expr_str"]
        sizes[0]["as_expr"]["expr_str"] = f'Max({symbol}, "{touch_code(marker)} or 1")'

    edit_json(records, "models/model.json", edit)


def guard_code(records: dict[str, bytes], marker: Path) -> None:
    code = f"{touch_code(marker)} is None"
    edit_json(records, "models/model.json", lambda p: p.update(guards_code=[code]))


def python_target(records: dict[str, bytes], marker: Path) -> None:
    def edit(program: dict) -> None:
        program["graph_module"]["graph"]["nodes"][3]["target"] = "torch.os.system"

    edit_json(records, "models/model.json", edit)


def custom_namespace(records: dict[str, bytes], marker: Path) -> None:
    def edit(program: dict) -> None:
        program["graph_module"]["graph"]["nodes"][3]["target"] = "torch.ops.mylib.evil.default"

    edit_json(records, "models/model.json", edit)


def injected_name(records: dict[str, bytes], marker: Path) -> None:
    # FX writes getattr(self, "<name>") into Python source for parameter names.
    name = 'x"),exec("1"),getattr(self,"y'

    def edit(program: dict) -> None:
        program["graph_module"]["signature"]["input_specs"][0]["parameter"]["parameter_name"] = name

    edit_json(records, "models/model.json", edit)


RUNS_UNCHECKED = [
    pickled_weight,
    pickled_constant,
    pickled_example_inputs,
    shape_expression,
    guard_code,
]
HOSTILE_PROGRAMS = [
    *(attack for attack in RUNS_UNCHECKED if attack is not guard_code),
    opaque_constant,
    legacy_weights,
    native_library,
    python_target,
    custom_namespace,
    injected_name,
]


# Deliberately unsafe, to prove each attack real: plain torch loads and runs the hostile
# file in a separate process, whose only effect is the marker. slidesnake never does this;
# test_a_hostile_program_is_refused_before_torch_reads_it shows it refuses the same files.
UNCHECKED_TORCH = """
import sys, torch
try:
    torch.export.load(sys.argv[1]).module()(torch.zeros(1, 3, 224, 224))
except Exception:
    pass  # the payload runs before whatever fails
"""


@pytest.mark.slow  # a fresh torch per attack
@pytest.mark.parametrize("attack", RUNS_UNCHECKED, ids=lambda f: f.__name__)
def test_unchecked_torch_runs_the_payload_of_a_hostile_program(tmp_path, program, attack):
    marker = tmp_path / "marker"
    path = rewrite(program, tmp_path / "hostile.pt2", lambda r: attack(r, marker))
    subprocess.run([sys.executable, "-c", UNCHECKED_TORCH, str(path)], check=True)
    assert marker.exists()


@pytest.mark.parametrize("attack", HOSTILE_PROGRAMS, ids=lambda f: f.__name__)
def test_a_hostile_program_is_refused_before_torch_reads_it(tmp_path, program, attack):
    marker = tmp_path / "marker"
    path = rewrite(program, tmp_path / "hostile.pt2", lambda r: attack(r, marker))
    with pytest.raises(ModelError, match=rf"checkpoint {path} is refused: .*would run code"):
        build_embedder(model_spec("custom"), "checkpoint", str(path), 224, CPU, "fp32")
    assert not marker.exists()


# torch.export.save writes guard code, and torch.export.load runs it, from torch 2.9 on.
GUARDS = pytest.mark.skipif(torch.__version__ < "2.9", reason="guard code needs torch 2.9")


@GUARDS
def test_guard_code_is_dropped_never_run(tmp_path, program):
    marker = tmp_path / "marker"
    path = rewrite(program, tmp_path / "guarded.pt2", lambda r: guard_code(r, marker))
    embedder = build_embedder(model_spec("custom"), "checkpoint", str(path), 224, CPU, "fp32")
    assert embedder.dim == 64
    assert not marker.exists()


@GUARDS
@pytest.mark.parametrize("attack", HOSTILE_PROGRAMS, ids=lambda f: f.__name__)
def test_guard_code_opens_no_way_around_the_check(tmp_path, program, attack):
    """An archive with guard code is loaded from a copy: every attack beside the guard
    code is still refused, and neither payload runs."""
    marker, guard_marker = tmp_path / "marker", tmp_path / "guard-marker"

    def both(records: dict[str, bytes]) -> None:
        guard_code(records, guard_marker)
        attack(records, marker)

    path = rewrite(program, tmp_path / "hostile.pt2", both)
    with pytest.raises(ModelError, match=rf"checkpoint {path} is refused: .*would run code"):
        build_embedder(model_spec("custom"), "checkpoint", str(path), 224, CPU, "fp32")
    assert not marker.exists() and not guard_marker.exists()


class TwoInputEncoder(torch.nn.Module):
    """A slide encoder as users export them: features and coordinates sharing N."""

    def __init__(self) -> None:
        super().__init__()
        self.features, self.coords = torch.nn.Linear(8, 16), torch.nn.Linear(2, 16)

    def forward(self, features: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
        return (self.features(features) + self.coords(coords)).mean(0)


@PT2
def test_a_real_two_input_slide_encoder_loads_and_still_checks_its_shapes(tmp_path):
    from slidesnake.aggregate.encoder import encode_slide
    from slidesnake.embed.store import EmbeddingWriter

    tiles = torch.export.Dim("tiles", min=1)
    module = TwoInputEncoder().eval()
    example = (torch.randn(5, 8), torch.randn(5, 2))
    shared = {"features": {0: tiles}, "coords": {0: tiles}}
    program = torch.export.export(module, example, dynamic_shapes=shared)
    path = tmp_path / "encoder.pt2"
    torch.export.save(program, str(path))
    with zipfile.ZipFile(path) as archive:  # the case the archive check used to refuse
        model = next(n for n in archive.namelist() if n.endswith("models/model.json"))
        assert json.loads(archive.read(model))["guards_code"]
    coords = np.array([[0, 0], [224, 0], [448, 0]], np.int64)
    features = np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32)
    writer = EmbeddingWriter(tmp_path / "e.zarr", coords, 8, "float32")
    writer.put(np.arange(3), features)
    writer.finish({"model": "test"})
    vector = encode_slide(path, tmp_path / "e.zarr")
    with torch.inference_mode():
        expected = module(torch.from_numpy(features), torch.from_numpy(coords).float())
    np.testing.assert_allclose(vector, expected.numpy(), rtol=1e-5, atol=1e-6)
    from slidesnake.models.checkpoints import load_program

    with pytest.raises(Exception, match="Guard failed"):  # the shape relation, as data
        load_program(path, CPU)(torch.zeros(3, 8), torch.zeros(2, 2))


def test_the_untouched_program_still_loads(tmp_path, program):
    copy = rewrite(program, tmp_path / "copy.pt2", lambda records: None)
    embedder = build_embedder(model_spec("custom"), "checkpoint", str(copy), 224, CPU, "fp32")
    assert embedder.dim == 64


# --- state dicts and TorchScript -----------------------------------------------------


def state_dict_pickle(path: Path, marker: Path) -> None:
    torch.save({"state_dict": tiny_vit().state_dict(), "args": Payload(marker)}, path)


def legacy_pickle(path: Path, marker: Path) -> None:
    torch.save(Payload(marker), path, _use_new_zipfile_serialization=False)


def plain_pickle(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps(Payload(marker)))


def torchscript_pickle(path: Path, marker: Path) -> None:
    """A TorchScript archive whose data.pkl unpickles the payload."""
    torch.jit.save(torch.jit.trace(tiny_vit(), torch.zeros(1, 3, 224, 224)), str(path))
    with zipfile.ZipFile(path) as archive:
        records = {name: archive.read(name) for name in archive.namelist()}
    data = next(name for name in records if name.endswith("/data.pkl"))
    records[data] = pickle.dumps(Payload(marker), protocol=2)
    with zipfile.ZipFile(path, "w") as archive:
        for name, content in records.items():
            archive.writestr(name, content)


@pytest.mark.parametrize(
    ("filename", "make", "name"),
    [
        ("weights.pt", state_dict_pickle, "timm:test_vit"),
        ("checkpoint.pth", legacy_pickle, "timm:test_vit"),
        ("pytorch_model.bin", plain_pickle, "timm:test_vit"),
        ("scripted.pt", torchscript_pickle, "custom"),
    ],
)
def test_hostile_state_dicts_and_torchscript_run_nothing(tmp_path, filename, make, name):
    marker = tmp_path / "marker"
    path = tmp_path / filename
    make(path, marker)
    with pytest.raises(ModelError, match=f"checkpoint {path} "):
        build_embedder(model_spec(name), "checkpoint", str(path), 224, CPU, "fp32")
    assert not marker.exists()


# --- the job: one line naming the slide, the file and the reason ----------------------


def slidesnake(*args: object) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "slidesnake", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True)


def test_a_job_with_a_hostile_checkpoint_fails_its_slide_with_one_line(tmp_path, program):
    slide = write_slide(tmp_path / "s1.svs", 2048, 2048, [Rect(0, 0, 2048, 2048)], mpp=0.5)
    out = tmp_path / "out"
    assert slidesnake("mask", slide, out).returncode == 0
    assert slidesnake("tiles", slide, out).returncode == 0
    marker = tmp_path / "marker"
    hostile = rewrite(program, tmp_path / "model.pt2", lambda r: pickled_weight(r, marker))
    result = slidesnake(
        "embed", slide, out / "tiles.parquet", out, "--model", "custom", "--checkpoint", hostile
    )
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, result.stderr
    assert "slide 's1'" in errors[0] and f"checkpoint {hostile} is refused" in errors[0]
    assert "stores 'cls_token' as a pickle" in errors[0]
    assert not marker.exists()
    assert not (out / "embeddings.zarr").exists()


# --- names: no slide id can be a cohort output or leave its folder ---------------------


@pytest.fixture(scope="module")
def small_slide(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("small") / "small.svs"
    return write_slide(path, 2048, 2048, [Rect(448, 448, 1792, 1792)], mpp=0.5, levels=2)


def cohort_status(workflow) -> dict[str, str]:
    rows = (workflow.dir / "results" / "cohort.tsv").read_text().splitlines()[1:]
    return {row.split("\t")[0]: row.split("\t")[1] for row in rows}


@pytest.mark.workflow
def test_slide_ids_named_like_cohort_outputs_destroy_nothing(workflow, small_slide):
    ids = ["cohort.tsv", "cohort.html", "summarize_cohort.log", "slides", "report.html"]
    workflow.sheet([(slide_id, small_slide) for slide_id in ids])
    workflow.run()
    assert cohort_status(workflow) == dict.fromkeys(ids, "done")
    assert (workflow.dir / "results" / "cohort.html").is_file()
    for slide_id in ids:
        assert workflow.result(slide_id, "metrics.json").is_file()
    assert "Nothing to be done" in workflow.run().stderr


@pytest.mark.parametrize(
    "slide_id",
    ["-rf", ".hidden", "..", "a..b", "x" * 129, "esc\x1bape", "bell\x07", "nul\x00", "é"],
)
def test_ids_that_are_not_portable_file_names_are_refused(tmp_path, small_slide, slide_id):
    sheet = tmp_path / "s.tsv"
    sheet.write_text(f"slide_id\tpath\n{slide_id}\t{small_slide}\n")
    with pytest.raises(SampleSheetError):
        read_sample_sheet(sheet)


# --- values pandas would reinterpret, paths that are not slide files -----------------


def test_sheet_cells_are_read_as_the_text_they_are(tmp_path):
    (tmp_path / "case#3.svs").touch()
    for name in ("NA.svs", "null.svs"):
        (tmp_path / name).touch()
    sheet = tmp_path / "s.tsv"
    sheet.write_text(
        "slide_id\tpath\tmpp\n# a comment line\nNA\tNA.svs\t\nnull\tnull.svs\t0.25\n"
        "case3\tcase#3.svs\t\n"
    )
    samples = read_sample_sheet(sheet, base_dir=tmp_path)
    assert list(samples.index) == ["NA", "null", "case3"]
    assert samples.loc["case3", "path"] == "case#3.svs"
    assert samples.loc["null", "mpp"] == 0.25 and samples["mpp"].isna().sum() == 2


def test_paths_that_are_not_regular_files_are_refused(tmp_path):
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "pipe")
    rows = [("folder", "folder"), ("pipe", "pipe"), ("device", "/dev/null")]
    sheet = tmp_path / "s.tsv"
    sheet.write_text("slide_id\tpath\n" + "".join(f"{i}\t{p}\n" for i, p in rows))
    with pytest.raises(SampleSheetError) as raised:
        read_sample_sheet(sheet, base_dir=tmp_path)
    assert "slide 'folder': folder is a directory" in str(raised.value)
    assert "slide 'pipe': pipe is not a regular file" in str(raised.value)
    assert "slide 'device': /dev/null is not a regular file" in str(raised.value)


@pytest.mark.parametrize("mpp", ["0", "-0.5", "352.7", "nan", "inf", "0,25", "x"])
def test_an_implausible_sheet_mpp_is_refused(tmp_path, small_slide, mpp):
    sheet = tmp_path / "s.tsv"
    sheet.write_text(f"slide_id\tpath\tmpp\ns\t{small_slide}\t{mpp}\n")
    with pytest.raises(SampleSheetError, match=f"mpp '{re.escape(mpp)}' is not a number"):
        read_sample_sheet(sheet)


def test_missing_and_shared_files_are_warnings(tmp_path, small_slide):
    (tmp_path / "link.svs").symlink_to(small_slide)
    rows = [("a", small_slide), ("b", tmp_path / "link.svs"), ("gone", tmp_path / "gone.svs")]
    samples = read_sample_sheet(write_sheet(tmp_path / "s.tsv", rows))
    warnings = sheet_warnings(samples)
    assert any("slide 'gone': file not found" in w for w in warnings)
    assert any("slides ['a', 'b'] are the same file" in w for w in warnings)


@pytest.mark.workflow
def test_a_deleted_slide_fails_its_own_jobs_and_the_cohort_runs(workflow, small_slide, tmp_path):
    workflow.sheet([("kept", small_slide), ("deleted", tmp_path / "deleted.svs")])
    result = workflow.run(check=False)
    assert result.returncode != 0
    assert "sample sheet: slide 'deleted': file not found" in result.stderr
    assert cohort_status(workflow) == {"kept": "done", "deleted": "failed"}
    assert "slide 'deleted'" in workflow.log("deleted", "make_tissue_mask")


# --- config: checked whole, one line per problem --------------------------------------


def repo_config(**sections: dict) -> dict:
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for section, values in sections.items():
        config[section] |= values
    return config


def test_every_config_problem_is_one_line_naming_its_key():
    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    config = repo_config(
        tiles={"size": 100_000, "mpp": 0},
        loader={"workers": 10_000},
        model={"batch_size": 0, "precision": "fp8"},
    )
    config["tisue"] = {}
    with pytest.raises(ConfigError) as raised:
        check_config(config, schema)
    lines = str(raised.value).splitlines()[1:]
    for key in ("tiles.size", "tiles.mpp", "loader.workers", "model.batch_size", "model.precision"):
        assert sum(line.strip().startswith(f"{key}: ") for line in lines) == 1, lines
    assert any("'tisue' was unexpected" in line for line in lines)
    assert len(lines) == 6


@pytest.mark.parametrize("name", ["timm:vit_tiny_patch16_224x", "timm:not_a_model"])
def test_a_timm_architecture_timm_does_not_know_is_a_config_error(name):
    with pytest.raises(ConfigError, match="timm has no architecture"):
        check_model_config({"name": name, "weights": "random"}, {"size": 224, "mpp": 0.5})


# --- re-runs follow results, not spelling ---------------------------------------------


def reversed_sections(config: dict) -> dict:
    return {
        key: dict(reversed(value.items())) if isinstance(value, dict) else value
        for key, value in reversed(config.items())
    }


@pytest.mark.workflow
def test_reruns_follow_results_not_spelling(workflow, small_slide):
    workflow.sheet([("s", small_slide)])
    workflow.run()
    path = workflow.dir / "config" / "config.yaml"
    config = yaml.safe_load(path.read_text())
    same = reversed_sections(config)
    same["tissue"]["mpp"] = int(same["tissue"]["mpp"])  # 8 for 8.0
    same["embed"] = {"progress_s": 1, "watchdog_s": 7}
    same["loader"] = {"workers": 2, "prefetch": 1, "block": 8}
    same["gpu"] = {"ids": [0]}
    same["tissue"]["max_decode_mpx"] = 5
    path.write_text(yaml.safe_dump(same, sort_keys=False))
    assert "Nothing to be done" in workflow.run().stderr
    # Floats for integers (32.0 for the tests' batch size), a default spelled out.
    floats = ("--config", "model={batch_size: 32.0}", "tiles={size: 224.0, stride: 224}")
    assert "Nothing to be done" in workflow.run(*floats).stderr
    same["tiles"]["mask_threshold"] = 0.9  # a setting that changes the tiles
    path.write_text(yaml.safe_dump(same, sort_keys=False))
    rerun = workflow.run(*floats)  # and the jobs read the integers they need
    assert jobs_run(rerun, "make_tile_coords") == ["s"]
    assert jobs_run(rerun, "embed_tiles") == ["s"]
    assert jobs_run(rerun, "make_tissue_mask") == []


# --- work that cannot end -------------------------------------------------------------


def test_masking_refuses_to_decode_more_than_its_bound(tmp_path):
    flat = write_slide(
        tmp_path / "flat.tif",
        4096,
        4096,
        [Rect(0, 0, 4096, 4096)],
        mpp=0.5,
        levels=1,
        vendor="generic",
    )
    params = TissueParams(max_decode_mpx=10)
    with pytest.raises(SlideSizeError) as raised:
        make_tissue_mask(flat, "flat", tmp_path / "m.png", tmp_path / "q.png", params)
    message = str(raised.value)
    assert message.startswith(f"slide 'flat' ({flat}): masking would decode 17 Mpx")
    assert "tissue.max_decode_mpx" in message and "pyramidal" in message
    assert not (tmp_path / "m.png").exists()
    make_tissue_mask(flat, "flat", tmp_path / "m.png", tmp_path / "q.png", TissueParams())
    assert (tmp_path / "m.png").is_file()


# --- the cohort table says what happened in this run ---------------------------------


@pytest.mark.workflow
def test_a_slide_replaced_by_a_broken_file_is_failed_not_done(workflow, small_slide, tmp_path):
    slide = tmp_path / "case.svs"
    shutil.copy(small_slide, slide)
    workflow.sheet([("case", slide), ("other", small_slide)])
    workflow.run()
    assert cohort_status(workflow) == {"case": "done", "other": "done"}
    slide.write_bytes(b"II*\x00 replaced by something broken")
    result = workflow.run(check=False)
    assert result.returncode != 0
    table = (workflow.dir / "results" / "cohort.tsv").read_text()
    assert cohort_status(workflow) == {"case": "failed", "other": "done"}
    assert f"slide 'case' ({slide})" in table
    assert workflow.result("case", "metrics.json").is_file()  # the old outputs, not trusted


def run_job_in_process(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    """A real job process: `body` is the stage, run by run_job with a log and a slide."""
    code = run_job_script(tmp_path, body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("raise MemoryError('cannot allocate 30 GB')", "unexpected MemoryError: cannot allocate"),
        ("raise OSError(28, 'No space left on device')", "unexpected OSError: [Errno 28]"),
        ("import timm; timm.create_model('no_such_model')", "unexpected RuntimeError: Unknown"),
    ],
)
def test_an_unexpected_error_is_one_line_naming_the_slide(tmp_path, body, error):
    result = run_job_in_process(tmp_path, body)
    assert result.returncode == 1
    log = (tmp_path / "logs" / "s" / "embed_tiles.log").read_text()
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"slide 's': {error}" in errors[0], log
    assert "Traceback (most recent call last)" in log
    reason = failure_in_run(tmp_path / "logs" / "s", since=0)
    assert reason.startswith(f"slide 's': {error}")


def test_a_killed_job_is_failed_in_the_table(tmp_path):
    job = subprocess.Popen(
        [sys.executable, "-c", run_job_script(tmp_path, "import time; time.sleep(60)")]
    )
    log = tmp_path / "logs" / "s" / "embed_tiles.log"
    for _ in range(100):
        if log.is_file():
            break
        time.sleep(0.1)
    job.kill()
    job.wait()
    assert "stopped without a result (killed?)" in failure_in_run(log.parent, since=0)
    finished = run_job_in_process(tmp_path, "pass")
    assert finished.returncode == 0
    assert failure_in_run(log.parent, since=0) == ""


def run_job_script(tmp_path: Path, body: str) -> str:
    return (
        "import logging\nfrom slidesnake.cohort.jobs import run_job\n"
        f"def stage():\n    logging.getLogger('slidesnake').info('working')\n    {body}\n"
        f"run_job(stage, log_path={str(tmp_path / 'logs' / 's' / 'embed_tiles.log')!r}, "
        "slide_id='s')\n"
    )


# --- reading results back -------------------------------------------------------------


def test_load_embeddings_reads_only_finished_stores(tmp_path):
    from slidesnake.embed.store import EmbeddingWriter

    coords = np.array([[0, 0], [224, 0]], np.int64)
    temporary = tmp_path / ".embeddings.zarr.tmp-123"
    writer = EmbeddingWriter(temporary, coords, 4, "float16")
    writer.put(np.arange(2), np.ones((2, 4), np.float32))
    with pytest.raises(EmbeddingsError, match="temporary store of an embedding job"):
        load_embeddings(temporary)
    unfinished = tmp_path / "embeddings.zarr"
    EmbeddingWriter(unfinished, coords, 4, "float16")
    with pytest.raises(EmbeddingsError, match="not a finished embeddings store"):
        load_embeddings(unfinished)
    with pytest.raises(EmbeddingsError, match="not an embeddings store slidesnake wrote"):
        load_embeddings(tmp_path / "nowhere.zarr")


@pytest.mark.parametrize(
    ("source", "target", "message"),
    [
        ("nowhere.zarr", "out.h5", "nowhere.zarr is not an embeddings store"),
        (".embeddings.zarr.tmp-9", "out.h5", "temporary store"),
    ],
)
def test_export_h5_errors_are_one_line(tmp_path, source, target, message):
    (tmp_path / source).mkdir()
    result = slidesnake("export-h5", tmp_path / source, tmp_path / target)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and message in errors[0], result.stderr


# --- a changed slide is noticed, whatever its modification time ----------------------


@pytest.mark.workflow
def test_a_slide_replaced_with_an_older_mtime_is_redone(workflow, small_slide, tmp_path):
    slide = tmp_path / "case.svs"
    shutil.copy(small_slide, slide)
    workflow.sheet([("case", slide)])
    workflow.run()
    before = load_embeddings(workflow.result("case", "embeddings.zarr"))[1]
    other = write_slide(tmp_path / "other.svs", 2048, 2048, [Rect(0, 0, 896, 896)], mpp=0.5)
    shutil.copy(other, slide)
    os.utime(slide, (1e9, 1e9))  # 2001: older than every output, as cp -p or a restore leaves it
    rerun = workflow.run()
    assert jobs_run(rerun, "make_tissue_mask") == ["case"]
    assert jobs_run(rerun, "embed_tiles") == ["case"]
    after = load_embeddings(workflow.result("case", "embeddings.zarr"))[1]
    assert len(after) != len(before)
    assert "Nothing to be done" in workflow.run().stderr


@pytest.mark.workflow
def test_a_failed_slides_line_reaches_the_terminal_once(workflow, small_slide, tmp_path):
    broken = tmp_path / "broken.svs"
    broken.write_text("not a slide\n")
    workflow.sheet([("broken", broken), ("fine", small_slide)])
    result = workflow.run(check=False)
    lines = [line for line in result.stderr.splitlines() if f"slide 'broken' ({broken})" in line]
    assert len(lines) == 1, result.stderr
    assert cohort_status(workflow) == {"broken": "failed", "fine": "done"}

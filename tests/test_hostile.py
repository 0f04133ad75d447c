"""Hostile inputs: files written to attack the job, each a member of a class of attack.

Checkpoints: every format a user can point `model.checkpoint` at, made to run code (a
payload that would create a marker file). For the .pt2 members that torch itself would
run, a first test proves the attack is real: unchecked, torch runs the payload.
"""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import pickle
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_models import export, tiny_vit

from slidesnake.errors import ModelError
from slidesnake.models.embedder import build_embedder
from slidesnake.models.registry import model_spec
from slidesnake.slides.synthetic import Rect, write_slide

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
    *RUNS_UNCHECKED,
    opaque_constant,
    legacy_weights,
    native_library,
    python_target,
    custom_namespace,
    injected_name,
]


@pytest.mark.parametrize("attack", RUNS_UNCHECKED, ids=lambda f: f.__name__)
def test_unchecked_torch_runs_the_payload_of_a_hostile_program(tmp_path, program, attack):
    marker = tmp_path / "marker"
    path = rewrite(program, tmp_path / "hostile.pt2", lambda r: attack(r, marker))
    with contextlib.suppress(Exception):  # the payload runs before whatever fails
        torch.export.load(str(path)).module()(torch.zeros(1, 3, 224, 224))
    assert marker.exists()


@pytest.mark.parametrize("attack", HOSTILE_PROGRAMS, ids=lambda f: f.__name__)
def test_a_hostile_program_is_refused_before_torch_reads_it(tmp_path, program, attack):
    marker = tmp_path / "marker"
    path = rewrite(program, tmp_path / "hostile.pt2", lambda r: attack(r, marker))
    with pytest.raises(ModelError, match=rf"checkpoint {path} is refused: .*would run code"):
        build_embedder(model_spec("custom"), "checkpoint", str(path), 224, CPU, "fp32")
    assert not marker.exists()


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

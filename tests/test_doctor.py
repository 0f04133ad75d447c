"""`slidesnake doctor`: on this machine every line is OK or an honest note (no GPU), and
each line that can fail here fails with its fix. The GPU lines (a device's name, memory,
driver, and fp16/bf16 tried on it) need a GPU: benchmarks/gpu_check.sh runs the doctor."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch
import yaml
from conftest import TEST_MODEL, write_sheet
from safetensors.torch import save_file

from slidesnake import doctor
from slidesnake.cohort.config import load_config
from slidesnake.models.embedder import build_network
from slidesnake.models.registry import model_spec


@pytest.fixture
def project(tmp_path, rect_slide, monkeypatch) -> Path:
    """A run's directory: the tests' model, a sheet of one slide."""
    (tmp_path / "config").mkdir()
    write_sheet(tmp_path / "config" / "samples.tsv", [("rect", rect_slide)])
    (tmp_path / "config" / "config.yaml").write_text(yaml.safe_dump(TEST_MODEL))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def config_with(project: Path, **sections) -> dict:
    path = project / "config" / "run.yaml"
    path.write_text(yaml.safe_dump(sections))
    return load_config([project / "config" / "config.yaml", path])


def only(findings: list[doctor.Finding]) -> doctor.Finding:
    assert len(findings) == 1, findings
    return findings[0]


def test_on_this_machine_every_line_is_ok_or_a_note(project):
    command = [sys.executable, "-m", "slidesnake", "doctor"]
    answer = subprocess.run(command, capture_output=True, text=True, cwd=project)
    assert answer.returncode == 0, answer.stdout + answer.stderr
    lines = answer.stdout.splitlines()
    checks = [line.split(":")[0].split()[1] for line in lines]
    for check in ("python", "packages", "torch", "openslide", "snakemake", "config",
                  "weights", "slides", "disk"):  # fmt: skip
        assert check in checks, answer.stdout
    for line in lines:
        assert line.startswith("OK ") or line.startswith("NOTE "), line
    if not torch.cuda.is_available():
        assert "NOTE  gpu: no GPU visible" in answer.stdout


def test_an_old_python_fails():
    finding = only(doctor.python_check((3, 10, 4)))
    assert finding.status == "FAIL" and "Python 3.10.4; slidesnake needs 3.11" in finding.message


def test_packages_out_of_range_or_missing_fail_with_the_install_command():
    assert only(doctor.packages_check()).status == "OK"
    finding = only(doctor.packages_check(["numpy<1", "no-such-package-4f2a>=1"]))
    assert finding.status == "FAIL"
    assert f"numpy {numpy.__version__} is outside <1" in finding.message
    assert "no-such-package-4f2a is not installed" in finding.message
    assert "pip install -e ." in finding.message


def test_openslide_that_cannot_load_fails():
    assert only(doctor.openslide_check()).status == "OK"
    finding = only(doctor.openslide_check("no_such_openslide_9c1"))
    assert finding.status == "FAIL" and "pip install openslide-bin" in finding.message


def test_slurm_that_does_not_answer_fails(tmp_path, monkeypatch):
    # Without the SLURM profile no cluster is asked (the plugin's own start cost aside).
    checks = [f.check for f in doctor.snakemake_check(slurm=False)]
    assert checks[0] == "snakemake" and "slurm" not in checks
    missing = doctor.snakemake_check(slurm=True, sinfo=str(tmp_path / "sinfo"))[-1]
    assert missing.status == "FAIL" and "sinfo did not answer" in missing.message
    if subprocess.run(["which", "sinfo"], capture_output=True).returncode != 0:
        pytest.skip("no SLURM commands here")
    # A controller nobody runs: sinfo itself answers that it cannot reach it.
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=none\nSlurmctldHost=localhost\nSlurmctldPort=9\n"
                    "MessageTimeout=1\nNodeName=n0 CPUs=1\nPartitionName=p Nodes=n0\n")  # fmt: skip
    monkeypatch.setenv("SLURM_CONF", str(conf))
    finding = doctor.snakemake_check(slurm=True)[-1]
    assert finding.status == "FAIL" and "SLURM does not answer" in finding.message


def test_the_slurm_plugins_cost_at_every_start_is_said_with_its_fix(tmp_path, monkeypatch):
    """Where SLURM's clients are installed, the SLURM executor plugin runs at every
    Snakemake start: doctor says what it costs, and when it will stop Snakemake, which a
    real start then confirms."""
    if shutil.which("sinfo") is None or shutil.which("scontrol") is None:
        pytest.skip("no SLURM commands here")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=none\nSlurmctldHost=localhost\nSlurmctldPort=9\n"
                    "MessageTimeout=1\nNodeName=n0 CPUs=1\nPartitionName=p Nodes=n0\n")  # fmt: skip
    monkeypatch.setenv("SLURM_CONF", str(conf))
    stalled = only(doctor.slurm_plugin_check())
    assert stalled.status == "NOTE" and "no controller answers" in stalled.message
    assert "every Snakemake start" in stalled.message and " s for it here" in stalled.message
    assert "pip uninstall snakemake-executor-plugin-slurm" in stalled.message
    # sinfo without sacct and squeue, as on a machine with part of SLURM's clients.
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("sinfo", "which"):
        (bare / tool).symlink_to(shutil.which(tool))
    refused = only(doctor.slurm_plugin_check(path=str(bare)))
    assert refused.status == "FAIL" and "without sacct or squeue" in refused.message
    assert "pip uninstall snakemake-executor-plugin-slurm" in refused.message
    (tmp_path / "Snakefile").write_text("rule all:\n    shell: 'true'\n")
    start = [sys.executable, "-m", "snakemake", "-n", "--cores", "1"]
    for path, starts in ((str(bare), False), (os.environ["PATH"], True)):
        env = {**os.environ, "PATH": f"{path}:{Path(sys.executable).parent}"}
        run = subprocess.run(start, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert (run.returncode == 0) is starts, run.stderr[-2000:]
        assert starts or "Neither 'sacct' nor 'squeue'" in run.stderr


def test_weights_lines(project, tmp_path, monkeypatch):
    spec = model_spec("timm:test_vit")
    state = {k: v.contiguous() for k, v in build_network(spec, 224).network.state_dict().items()}
    good = tmp_path / "good.safetensors"
    save_file(state, good)
    model = TEST_MODEL["model"]
    finding = only(doctor.weights_check(config_with(project)))
    assert finding.status == "NOTE" and "random weights" in finding.message

    config = config_with(project, model={**model, "weights": "checkpoint", "checkpoint": str(good)})
    assert only(doctor.weights_check(config)).status == "OK"

    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(good.read_bytes()[:5000])
    config = config_with(
        project, model={**model, "weights": "checkpoint", "checkpoint": str(truncated)}
    )
    finding = only(doctor.weights_check(config))
    assert finding.status == "FAIL" and "corrupt or truncated" in finding.message

    pickled = tmp_path / "pickled.pt"
    buffer = io.BytesIO()
    torch.save({**state, "args": slice(1, 2)}, buffer)
    pickled.write_bytes(buffer.getvalue())
    config = config_with(
        project, model={**model, "weights": "checkpoint", "checkpoint": str(pickled)}
    )
    finding = only(doctor.weights_check(config))
    assert finding.status == "FAIL" and "pickle of more than tensors" in finding.message

    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    uni = {"name": "uni", "weights": "checkpoint", "checkpoint": None}
    config = config_with(project, model=uni, tiles={"size": 224, "mpp": 0.5})
    finding = only(doctor.run_checks({"weights": lambda: doctor.weights_check(config)}))
    assert finding.status == "FAIL" and "not in the Hugging Face cache" in finding.message


def test_a_missing_weights_file_fails_the_weights_line(project, tmp_path):
    model = {**TEST_MODEL["model"], "weights": "checkpoint", "checkpoint": str(tmp_path / "x.pt")}
    config = config_with(project)
    config["model"] = {**config["model"], **model}
    finding = only(doctor.run_checks({"weights": lambda: doctor.weights_check(config)}))
    assert finding.status == "FAIL" and "does not exist" in finding.message


def test_a_server_that_is_not_there_fails_the_server_line(project, monkeypatch):
    """The line says how long doctor waited, and how long a job would wait (the config's
    remote.ready_timeout_s)."""
    monkeypatch.setattr(doctor, "SERVER_WAIT_S", 1.0)
    config = config_with(project, model={**TEST_MODEL["model"], "backend": "remote"},
                         remote={"url": "http://127.0.0.1:9", "model": "m",
                                 "ready_timeout_s": 45})  # fmt: skip
    finding = only(doctor.run_checks({"weights": lambda: doctor.weights_check(config)}))
    assert finding.status == "FAIL" and "http://127.0.0.1:9" in finding.message
    waited = "not ready within doctor's wait of 1 s (jobs wait remote.ready_timeout_s (45 s))"
    assert waited in finding.message


def test_a_slide_that_does_not_open_fails_the_slides_line(project, rect_slide):
    broken = project / "broken.svs"
    broken.write_bytes(b"not a slide at all" * 100)
    write_sheet(project / "config" / "samples.tsv", [("rect", rect_slide), ("broken", broken)])
    findings = doctor.slides_check(config_with(project))
    finding = only(findings)
    assert finding.status == "FAIL" and finding.message.startswith("1 of 2 slides cannot be read")
    assert "broken" in finding.message and str(broken) in finding.message


def test_too_little_disk_fails_and_enough_is_ok(project):
    config = config_with(project)
    sizes = [((40_000, 30_000), 0.25)] * 10
    assert only(doctor.disk_check(config, sizes)).status == "OK"
    finding = only(doctor.disk_check(config, sizes, free=10_000))
    assert finding.status == "FAIL" and "free space or run from another disk" in finding.message


def test_an_invalid_config_fails_its_line_and_skips_what_needs_it(project):
    (project / "config" / "bad.yaml").write_text("tiles: {size: -5}\n")
    findings = doctor.run_doctor(
        [project / "config" / "config.yaml", project / "config" / "bad.yaml"], slurm=False
    )
    config_line = next(f for f in findings if f.check == "config")
    assert config_line.status == "FAIL" and "tiles.size" in config_line.message
    assert not any(f.check in ("weights", "slides") for f in findings)


def test_a_check_that_breaks_is_a_fail_line_and_the_next_check_runs():
    def broken() -> list:
        raise KeyError("samples")

    findings = doctor.run_checks({"broken": broken, "python": doctor.python_check})
    assert findings[0] == doctor.Finding("FAIL", "broken", "unexpected KeyError: 'samples'")
    assert findings[1].check == "python" and findings[1].status == "OK"


def test_each_model_of_a_list_has_its_weights_line(project, tmp_path):
    models = {
        "vit": {"name": "timm:test_vit", "weights": "random"},
        "lost": {"name": "timm:test_vit", "checkpoint": str(tmp_path / "gone.safetensors")},
    }
    findings = {f.check: f for f in doctor.weights_check(config_with(project, models=models))}
    statuses = {check: finding.status for check, finding in findings.items()}
    assert statuses == {"weights vit": "NOTE", "weights lost": "FAIL"}
    assert "gone.safetensors does not exist" in findings["weights lost"].message


def test_the_decode_line_appears_with_gpu_decode_and_fails_without_nvimagecodec():
    assert doctor.decode_check({"loader": {"decode": "scaled"}}) == []
    (missing,) = doctor.decode_check({"loader": {"decode": "gpu"}}, module="no_such_codec")
    assert missing.status == "FAIL" and "pip install 'slidesnake[gpu-decode]'" in missing.message
    pytest.importorskip("nvidia.nvimgcodec")
    (found,) = doctor.decode_check({"loader": {"decode": "gpu"}})
    assert found.status == ("OK" if torch.cuda.is_available() else "NOTE")
    assert "nvImageCodec 0." in found.message

"""The warm interpreter (slidesnake.cohort.warm): a real server process, real clients in
their own processes, real jobs on synthetic slides. What must hold: a job run warm writes
what it writes in its own process, and fails, crashes or stops alone."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from conftest import REPO

from slidesnake.cohort import warm
from slidesnake.cohort.rule_jobs import warm_modules
from slidesnake.slides.synthetic import Rect, write_slide

CLIENT = (
    "import pickle, sys; from slidesnake.cohort.warm import run_rule; "
    "run_rule(pickle.load(open(sys.argv[1], 'rb')), sys.argv[2])"
)


def default_config(**sections) -> dict:
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for section, values in sections.items():
        config[section] |= values
    return config


def mask_job(slide: Path, out: Path, **tissue) -> SimpleNamespace:
    """What make_tissue_mask reads of its `snakemake` object."""
    out.mkdir(parents=True, exist_ok=True)
    return SimpleNamespace(
        params=SimpleNamespace(slide=str(slide), mpp=None),
        wildcards=SimpleNamespace(slide_id=slide.stem),
        output=SimpleNamespace(mask=str(out / "mask.png"), qc=str(out / "qc.png")),
        log=[str(out / "mask.log")],
        config=default_config(tissue=tissue),
    )


class Warm:
    """A socket directory of this test's own, its server, and clients."""

    def __init__(self, directory: Path, monkeypatch) -> None:
        directory.mkdir(mode=0o700)
        monkeypatch.setenv("SLIDESNAKE_WARM_DIR", str(directory))
        monkeypatch.delenv("SLIDESNAKE_WARM", raising=False)
        self.env = dict(os.environ)
        self.path = warm.socket_path()
        self.server: subprocess.Popen | None = None

    def start(self) -> Warm:
        """The server, as a client starts it: its log beside its socket."""
        with open(self.path.with_suffix(".log"), "ab") as log:
            command = [sys.executable, "-m", "slidesnake.cohort.warm", str(self.path)]
            self.server = subprocess.Popen(command, stdout=log, stderr=log)
        wait_for(lambda: listening(self.path))
        return self

    def forked(self) -> list[str]:
        log = self.path.with_suffix(".log")
        text = log.read_text() if log.exists() else ""
        return [line.split("forked ")[1] for line in text.splitlines() if "forked " in line]

    def client(self, job: SimpleNamespace, function: str, **env) -> subprocess.Popen:
        pickled = Path(job.log[0]).with_suffix(".job")
        pickled.write_bytes(pickle.dumps(job))
        command = [sys.executable, "-c", CLIENT, str(pickled), function]
        return subprocess.Popen(
            command, env=self.env | env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def run(self, job: SimpleNamespace, function: str, **env) -> subprocess.CompletedProcess:
        client = self.client(job, function, **env)
        stdout, stderr = client.communicate(timeout=300)
        return subprocess.CompletedProcess(client.args, client.returncode, stdout, stderr)

    def stop(self) -> None:
        """This test's server, whoever started it."""
        subprocess.run(["pkill", "-f", f"slidesnake.cohort.warm {self.path}"], check=False)
        if self.server is not None:
            self.server.wait(timeout=30)


@pytest.fixture
def server(tmp_path, monkeypatch):
    started = Warm(tmp_path / "warm", monkeypatch)
    yield started
    started.stop()


def listening(path: Path) -> bool:
    """Whether a socket at `path` accepts connections: it exists from its bind(), and a
    connection before its listen() is refused. /proc/net/unix flags 0x10000: listening."""
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 8 and fields[7] == str(path) and int(fields[3], 16) & 0x10000:
            return True
    return False


def wait_for(condition, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def slide(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("warm-slides") / "warm.svs"
    return write_slide(path, 4000, 3000, [Rect(500, 400, 3500, 2600)], mpp=0.5, levels=2)


@pytest.fixture(scope="module")
def slow_slide(tmp_path_factory) -> Path:
    """One level only, so its mask can be asked for at the slide's own resolution."""
    path = tmp_path_factory.mktemp("warm-slides") / "slow.svs"
    return write_slide(path, 3000, 2000, [Rect(300, 200, 2700, 1800)], mpp=0.5, levels=1)


def slow_job(slide: Path, out: Path) -> SimpleNamespace:
    """Minutes of median filter in one C call: SIGTERM waits for it, SIGKILL does not."""
    return mask_job(slide, out, mpp=0.5, blur_um=40.0)


def test_a_job_forked_warm_writes_what_it_writes_in_its_own_process(server, slide, tmp_path):
    alone = server.run(mask_job(slide, tmp_path / "alone"), "make_tissue_mask", SLIDESNAKE_WARM="0")
    assert alone.returncode == 0, alone.stderr
    server.start()
    warmed = server.run(mask_job(slide, tmp_path / "warm"), "make_tissue_mask")
    assert warmed.returncode == 0, warmed.stderr
    assert server.forked() and server.forked()[0].startswith("make_tissue_mask as pid")
    for name in ("mask.png", "qc.png"):
        assert (tmp_path / "warm" / name).read_bytes() == (tmp_path / "alone" / name).read_bytes()
    assert (tmp_path / "warm" / "mask.log").read_text().rstrip().endswith("job done")
    assert "job done" in warmed.stderr, "the child writes to the client's own stderr"


def test_the_first_job_runs_in_its_own_process_and_starts_a_server(server, slide, tmp_path):
    first = server.run(mask_job(slide, tmp_path / "first"), "make_tissue_mask")
    assert first.returncode == 0 and (tmp_path / "first" / "mask.png").is_file()
    wait_for(server.path.exists)
    second = server.run(mask_job(slide, tmp_path / "second"), "make_tissue_mask")
    assert second.returncode == 0 and len(server.forked()) == 1


def test_a_failing_job_fails_alone_with_its_line_and_the_server_serves_on(server, slide, tmp_path):
    server.start()
    broken = tmp_path / "broken.svs"
    broken.write_text("not a slide")
    failed = server.run(mask_job(broken, tmp_path / "broken"), "make_tissue_mask")
    assert failed.returncode == 1
    assert "ERROR" in failed.stderr and "broken" in failed.stderr
    assert "Traceback" not in failed.stderr
    after = server.run(mask_job(slide, tmp_path / "after"), "make_tissue_mask")
    assert after.returncode == 0 and len(server.forked()) == 2


def test_a_child_killed_mid_job_fails_its_job_only(server, slow_slide, slide, tmp_path):
    server.start()
    client = server.client(slow_job(slow_slide, tmp_path / "slow"), "make_tissue_mask")
    wait_for(lambda: server.forked())
    os.kill(int(server.forked()[0].split()[-1]), signal.SIGKILL)  # the OOM killer, say
    _, stderr = client.communicate(timeout=60)
    assert client.returncode == -signal.SIGKILL, stderr
    assert not (tmp_path / "slow" / "mask.png").exists()
    after = server.run(mask_job(slide, tmp_path / "after"), "make_tissue_mask")
    assert after.returncode == 0


def test_a_client_killed_mid_job_takes_its_child_with_it(server, slow_slide, tmp_path):
    server.start()
    client = server.client(slow_job(slow_slide, tmp_path / "slow"), "make_tissue_mask")
    wait_for(lambda: server.forked())
    child = int(server.forked()[0].split()[-1])
    client.kill()  # Snakemake killed, say: the server stops the job it ran for the client
    client.wait()
    wait_for(lambda: not Path(f"/proc/{child}").exists() or _zombie(child), timeout_s=30)
    assert server.server.poll() is None, "the server itself serves on"


@pytest.mark.slow
def test_sigterm_to_a_client_stops_its_job_cleanly(server, tmp_path):
    """The embedding job's own SIGTERM handling, through the client: temporary store
    removed, exit status 128 + SIGTERM, one line."""
    dense = write_slide(
        tmp_path / "dense.svs", 6000, 4500, [Rect(300, 200, 5700, 4300)], mpp=0.5, levels=2
    )
    for stage in ("mask", "tiles"):
        subprocess.run(
            [sys.executable, "-m", "slidesnake", stage, str(dense), str(tmp_path)], check=True
        )
    out = tmp_path / "out"
    out.mkdir()
    job = SimpleNamespace(
        params=SimpleNamespace(slide=str(dense)),
        wildcards=SimpleNamespace(slide_id="dense"),
        input=SimpleNamespace(tiles=str(tmp_path / "tiles.parquet")),
        output=SimpleNamespace(zarr=str(out / "embeddings.zarr"), metrics=str(out / "m.json")),
        log=[str(tmp_path / "embed.log")],
        config=default_config(
            model={"name": "timm:vit_tiny_patch16_224", "weights": "random", "precision": "fp32"},
            loader={"workers": 1},
        ),
    )
    server.start()
    client = server.client(job, "embed_tiles")
    wait_for(lambda: any(out.glob(".embeddings.zarr.tmp-*")), timeout_s=120)
    time.sleep(2)  # into the loop (as tests/test_failures.py: not inside zarr's creation)
    client.send_signal(signal.SIGTERM)
    _, stderr = client.communicate(timeout=60)
    assert client.returncode == 128 + signal.SIGTERM, stderr
    assert "stopped by SIGTERM" in stderr and "Traceback" not in stderr
    assert list(out.iterdir()) == [], "no output, no temporary left"


class _RunsCode:
    """A pickle that runs a command when loaded: what a hostile request would send."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to connect as a second user")
def test_the_server_unpickles_nothing_another_user_sends(tmp_path, monkeypatch):
    """The server runs what a request unpickles, so it reads requests from its own user
    only (SO_PEERCRED, before reading a byte); here the socket is made reachable, as a
    careless directory would make it, and another uid sends code."""
    reachable = Path(tempfile.mkdtemp(prefix="slidesnake-warm-test-"))  # not under pytest's 0700
    reachable.chmod(0o755)
    server = Warm(reachable / "warm", monkeypatch).start()
    server.path.parent.chmod(0o755)
    server.path.chmod(0o777)
    marker = tmp_path / "ran"
    request = pickle.dumps(_RunsCode(marker))
    child = os.fork()
    if child == 0:  # another user, nobody: exits 0 once connected
        connected = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.connect(str(server.path))
            connected = 0
            # The server may refuse, and close, before the request is all sent.
            with contextlib.suppress(ConnectionError):
                socket.send_fds(client, [struct.pack("!Q", len(request))], [0, 1, 2])
                client.sendall(request)
                client.recv(16)
        finally:
            os._exit(connected)
    try:
        assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0, "it did not connect"
        log = server.path.with_suffix(".log")
        wait_for(lambda: "refused a connection: a connection from uid 65534" in log.read_text())
        time.sleep(0.5)
        assert not marker.exists(), "the server ran another user's pickle"
        assert server.server.poll() is None, "and serves on"
    finally:
        server.stop()
        shutil.rmtree(reachable, ignore_errors=True)


def test_a_directory_others_can_enter_gets_no_server(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    monkeypatch.setenv("SLIDESNAKE_WARM_DIR", str(shared))
    assert warm.socket_path() is None
    shared.chmod(0o700)
    assert warm.socket_path() is not None
    if os.getuid() == 0:  # someone else's directory, however private
        os.chown(shared, 4321, 4321)
        assert warm.socket_path() is None
    monkeypatch.setenv("SLURM_JOB_ID", "7")  # one allocation per job: nothing to share
    shared.chmod(0o700)
    assert warm.socket_path() is None


def test_edited_code_or_another_environment_gets_a_server_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIDESNAKE_WARM_DIR", str(tmp_path / "warm"))
    before = warm.socket_path()
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # per job: the child applies it itself
    assert warm.socket_path() == before
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hub"))  # read once, at import
    assert warm.socket_path() != before
    monkeypatch.delenv("HF_HOME")
    assert warm.socket_path() == before
    monkeypatch.setattr(warm, "code_digest", lambda package: "another version")
    assert warm.socket_path() != before


def test_an_edit_that_keeps_size_and_mtime_changes_the_code_digest(tmp_path, monkeypatch):
    """`cp -p`, `rsync -a` or a checkout that restores times: the code is its content."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    package = tmp_path / "package"
    (package / "stage").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    module = package / "stage" / "mask.py"
    module.write_text("THRESHOLD = 0.25\n")
    before = warm.code_digest(package)
    assert warm.code_digest(package) == before  # cached, and stable
    times = module.stat()
    edited = tmp_path / "mask.py"
    edited.write_text("THRESHOLD = 0.75\n")
    os.utime(edited, ns=(times.st_atime_ns, times.st_mtime_ns))
    shutil.copy2(edited, module)  # what cp -p does
    assert (module.stat().st_size, module.stat().st_mtime_ns) == (times.st_size, times.st_mtime_ns)
    assert warm.code_digest(package) != before
    module.write_text("THRESHOLD = 0.25\n")
    assert warm.code_digest(package) == before


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_warm_interpreter_imports_a_stores_filesystem_for_its_slide_jobs_only():
    def job(slide):
        return SimpleNamespace(params=SimpleNamespace(slide=slide), config={"model": {}})

    assert "s3fs" in warm_modules("make_tissue_mask", job("s3://bucket/a.svs"))
    assert "aiohttp" in warm_modules("make_tile_coords", job("https://host/a.svs"))
    assert not {"s3fs", "aiohttp"} & set(warm_modules("make_tissue_mask", job("/data/a.svs")))
    assert "s3fs" not in warm_modules("pool_slide", job("s3://bucket/a.svs"))
    series = "https://pacs.example.org/dicom-web/studies/1.2/series/3.4"
    assert "wsidicom" in warm_modules("embed_tiles", job(series))

"""A warm interpreter: the jobs of a local run fork from a process that has imported
their stages once, instead of each starting Python and importing them again.

A slide's jobs are cheap next to their start: imports cost a masking or tiling job 0.7 s
of its 1 s, and an embedding job 1.5 s (torch) plus 1.7 s to import torch.export's
deserialiser for a `.pt2` program, per slide. So a rule's script (the client) hands its
`snakemake` object to a server over a Unix socket; the server imports what the job needs
(once per kind of job), forks, and the child runs the job with the client's standard
streams (passed over the socket), environment, working directory and start time. One job
is still one process, with its own log, exit status and failure: a child that crashes or
is killed fails its job only, the server serves the next. The client forwards SIGTERM and
SIGINT to its child, and the server stops a child whose client went away (Snakemake
killed it); a child dies with its server.

The first job of a run starts the server and runs in its own process, as every job does
where no server can serve it: under SLURM (one allocation per job), with SLIDESNAKE_WARM=0,
or when the socket's directory is not this user's alone. A server serves one interpreter
and one version of slidesnake's code (the socket's name is a digest of both), accepts
only its own user's connections, and exits after IDLE_S without a job.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import logging
import os
import pickle
import selectors
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from slidesnake.cohort.rule_jobs import JOBS, warm_up
from slidesnake.embed.startup import JOB_STARTED_ENV, process_started
from slidesnake.side_files import cached_digest, stat_key

IDLE_S = 60.0
# A job whose client went away gets SIGTERM (to remove its temporary outputs), then
# SIGKILL this long after: a job inside a long C call would not see SIGTERM before.
STOP_GRACE_S = 10.0
# How long a client waits for its job to be forked (the server may be importing torch).
FORK_TIMEOUT_S = 300.0
_HEADER = struct.Struct("!Q")
_REPLY = struct.Struct("!cq")  # b"P" + child pid, then b"S" + wait status
_STREAMS = 3  # stdin, stdout, stderr
# Snakemake sets these per job from its threads. Libraries read them once, at load (OpenMP
# sizes torch's thread pool then): the server starts without them, and a child applies
# its job's count to torch itself.
THREAD_VARIABLES = frozenset(
    ("OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
     "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")
)  # fmt: skip

log = logging.getLogger(__name__)


class WarmServerLost(Exception):
    """The server died while it ran this job: its child died with it."""


def run_rule(job: Any, function: str) -> None:
    """Run rule_jobs.`function` for the `snakemake` object `job`: in a warm interpreter
    when one serves this code, else in this process (starting a server for later jobs)."""
    status = _run_warm(job, function)
    if status is None:
        JOBS[function](job)
        return
    if os.WIFSIGNALED(status):  # end as the child ended, as Snakemake would have seen it
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    sys.exit(os.waitstatus_to_exitcode(status))


def socket_path() -> Path | None:
    """This interpreter's and this code's server socket, in a directory only this user can
    enter; None where that cannot be had (then jobs run in their own processes)."""
    if os.environ.get("SLIDESNAKE_WARM", "1") == "0" or "SLURM_JOB_ID" in os.environ:
        return None
    default = Path(tempfile.gettempdir()) / f"slidesnake-warm-{os.getuid()}"
    directory = Path(os.environ.get("SLIDESNAKE_WARM_DIR", default))
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.lstat()
    except OSError:
        return None
    private = stat.S_ISDIR(info.st_mode) and not info.st_mode & 0o077
    if not private or info.st_uid != os.getuid():
        return None
    return directory / f"{_server_digest()}.sock"


def _server_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}


def _server_digest() -> str:
    """A digest of the interpreter, the environment (libraries read some of it once, at
    import: HF_HOME, PYTHONPATH, ...) and slidesnake's code: an edited module or a
    changed environment gets a new server, never a stale one."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(f"{sys.executable}\0{sys.version}\0{package}".encode())
    for name, value in sorted(_server_environment().items()):
        digest.update(f"{name}={value}\0".encode())
    digest.update(code_digest(package).encode())
    return digest.hexdigest()[:20]


def code_digest(package: Path) -> str:
    """sha256 of the names and contents of a package's source files. Cached by their
    stats, change times included: an edit that keeps a file's size and modification time
    (`cp -p`, `rsync -a`, a checkout restoring times) still changes its change time."""
    files = sorted(package.rglob("*.py"))
    key = f"code {package}\0" + "\0".join(
        f"{path.relative_to(package)}\0{stat_key(path.stat())}" for path in files
    )

    def contents() -> str:
        digest = hashlib.sha256()
        for path in files:
            data = path.read_bytes()
            digest.update(f"{path.relative_to(package)}\0{len(data)}\0".encode() + data)
        return digest.hexdigest()

    return cached_digest(key, contents)


def _run_warm(job: Any, function: str) -> int | None:
    """The child's wait status, or None when no server took the job (nothing ran)."""
    path = socket_path()
    if path is None:
        return None
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(str(path))
    except OSError:
        client.close()
        _start_server(path)
        return None
    with client:
        try:
            _send_request(client, job, function)
            client.settimeout(FORK_TIMEOUT_S)
            child = _read_reply(client, b"P")
        except (OSError, WarmServerLost):
            return None  # no child was forked: the job runs here
        client.settimeout(None)
        _forward_signals(child)
        try:
            return _read_reply(client, b"S")
        except (OSError, WarmServerLost):
            print(
                f"slidesnake: the warm interpreter running this job (pid {child}) died, and "
                "the job with it; run again (SLIDESNAKE_WARM=0 runs every job in its own "
                "process)",
                file=sys.stderr,
            )
            return 1 << 8


def _send_request(client: socket.socket, job: Any, function: str) -> None:
    environment = dict(os.environ)
    environment.setdefault(JOB_STARTED_ENV, repr(process_started()))
    umask = os.umask(0o022)
    os.umask(umask)
    request = pickle.dumps(
        {
            "function": function,
            "job": pickle.dumps(job),
            "environment": environment,
            "cwd": os.getcwd(),
            "umask": umask,
        }
    )
    socket.send_fds(client, [_HEADER.pack(len(request))], list(range(_STREAMS)))
    client.sendall(request)


def _read_reply(client: socket.socket, kind: bytes) -> int:
    data = b""
    while len(data) < _REPLY.size:
        chunk = client.recv(_REPLY.size - len(data))
        if not chunk:
            raise WarmServerLost
        data += chunk
    got, value = _REPLY.unpack(data)
    if got != kind:
        raise WarmServerLost
    return value


def _forward_signals(child: int) -> None:
    """SIGTERM, SIGINT and SIGHUP to this client go to its child, as they would have come
    to this process (the child runs the job's own SIGTERM handling)."""

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)


def _start_server(path: Path) -> None:
    """Start a server for later jobs, detached from this job (Snakemake waits for the
    job's streams and process group, never for the server)."""
    with contextlib.suppress(OSError), open(path.with_suffix(".log"), "ab") as log_file:
        subprocess.Popen(
            [sys.executable, "-m", "slidesnake.cohort.warm", str(path)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,
            close_fds=True,
            env=_server_environment(),
        )


class _Server:
    """Accept jobs, fork them, report how they ended; one thread, one selector."""

    def __init__(self, path: Path, listener: socket.socket) -> None:
        self.path, self.listener = path, listener
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, socket.socket] = {}  # child pid -> its client
        self.stopping: dict[int, float] = {}  # child pid -> when SIGKILL follows SIGTERM
        self.last_job = time.monotonic()
        self.wakeup_read, self.wakeup_write = os.pipe()
        os.set_blocking(self.wakeup_read, False)
        os.set_blocking(self.wakeup_write, False)
        signal.set_wakeup_fd(self.wakeup_write)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wakeup_read, selectors.EVENT_READ, "reap")

    def serve(self) -> None:
        while self.children or time.monotonic() - self.last_job < IDLE_S:
            for key, _ in self.selector.select(timeout=1.0):
                if key.data == "accept":
                    try:
                        self._accept()
                    except Exception:  # one bad connection must not end the server
                        log.exception("a connection failed")
                elif key.data == "reap":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wakeup_read, 4096)
                else:
                    self._client_event(key.fileobj, key.data)
            self._reap()
            self._kill_overdue()
        log.info("no job for %.0f s: exiting", IDLE_S)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            pid, uid, _ = struct.unpack(
                "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            )
            if uid != os.getuid():
                raise PermissionError(f"a connection from uid {uid} (pid {pid})")
            conn.settimeout(10.0)
            request, streams = _receive_request(conn)
        except (OSError, ValueError, pickle.UnpicklingError) as err:
            log.warning("refused a connection: %s", err)
            conn.close()
            return
        self.last_job = time.monotonic()
        self._warm_up(request)
        try:
            child = os.fork()
        except OSError as err:  # the client sees the connection close: it runs the job
            log.warning("cannot fork %s: %s", request["function"], err)
            _close_all(conn, streams)
            return
        if child == 0:
            self._run_child(conn, request, streams)
        _close_all(None, streams)
        self.children[child] = conn
        log.info("forked %s as pid %d", request["function"], child)
        self.selector.register(conn, selectors.EVENT_READ, child)
        try:
            conn.sendall(_REPLY.pack(b"P", child))
        except OSError:  # the client is gone already: so is its job
            self._client_event(conn, child)

    def _warm_up(self, request: dict) -> None:
        try:
            warm_up(request["function"], pickle.loads(request["job"]))
        except Exception as err:  # the job does the same again, and says why it fails
            log.warning("could not warm up for %s: %s", request["function"], err)

    def _client_event(self, conn: socket.socket, child: int) -> None:
        """A client that sends anything, or goes away, before its child ended: stop it."""
        self.selector.unregister(conn)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child, signal.SIGTERM)
        self.stopping[child] = time.monotonic() + STOP_GRACE_S
        log.info("the client of job %d went away: stopping it", child)

    def _kill_overdue(self) -> None:
        now = time.monotonic()
        for child, deadline in list(self.stopping.items()):
            if child not in self.children:
                del self.stopping[child]
            elif now > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child, signal.SIGKILL)
                del self.stopping[child]

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(conn)
            with contextlib.suppress(OSError):
                conn.sendall(_REPLY.pack(b"S", status))
            conn.close()
            self.last_job = time.monotonic()

    def _run_child(self, conn: socket.socket, request: dict, streams: list[int]) -> None:
        """In the forked child: become the client's job, run it, never return."""
        code = 1
        try:
            os.setpgid(0, 0)
            _die_with_parent()
            signal.set_wakeup_fd(-1)
            for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(signum, signal.SIG_DFL)
            os.close(self.wakeup_read)
            os.close(self.wakeup_write)
            self.selector.close()
            self.listener.close()
            for other in self.children.values():
                other.close()
            conn.close()
            for target, fd in enumerate(streams):
                os.dup2(fd, target)
                os.close(fd)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["environment"])
            os.umask(request["umask"])
            _apply_threads()
            logging.getLogger().handlers.clear()
            JOBS[request["function"]](pickle.loads(request["job"]))
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else int(done.code is not None)
        except BaseException:
            traceback.print_exc()
        finally:
            logging.shutdown()
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)


def _close_all(conn: socket.socket | None, fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    if conn is not None:
        conn.close()


def _receive_request(conn: socket.socket) -> tuple[dict, list[int]]:
    header, streams, _, _ = socket.recv_fds(conn, _HEADER.size, _STREAMS)
    if len(header) != _HEADER.size or len(streams) != _STREAMS:
        for fd in streams:
            os.close(fd)
        raise ValueError("a request without its header and three standard streams")
    (size,) = _HEADER.unpack(header)
    data = bytearray()
    try:
        while len(data) < size:
            chunk = conn.recv(min(size - len(data), 1 << 20))
            if not chunk:
                raise ValueError("a request cut short")
            data += chunk
        return pickle.loads(data), streams
    except BaseException:
        _close_all(None, streams)
        raise


def _apply_threads() -> None:
    """The job's OMP_NUM_THREADS to torch's pool, which the server imported without it."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if "torch" in sys.modules and threads.isdigit() and int(threads) > 0:
        sys.modules["torch"].set_num_threads(int(threads))


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: the kernel kills this child if its server dies, so no job runs on
    unwatched after its client was told the server is gone."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def serve(path: Path) -> None:
    """Serve jobs at `path` until idle; a second server for the same path exits at once."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    with open(path.with_suffix(".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a server that died without cleaning up
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        os.chmod(path, 0o600)
        listener.listen(64)
        importlib.import_module("snakemake.script")  # what unpickling a job needs
        log.info("serving %s (pid %d)", path, os.getpid())
        try:
            _Server(path, listener).serve()
        finally:
            path.unlink(missing_ok=True)
            listener.close()


if __name__ == "__main__":
    serve(Path(sys.argv[1]))

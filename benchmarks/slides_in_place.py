"""The embedding job on a slide read from disk, from an S3 server, and from the same S3
server 20 ms away: whole jobs, process start to last byte.

moto's S3 server and a Range-capable HTTP server run on loopback; the latency is a small
HTTP proxy in front of each that holds every request for `--latency-ms` before passing it
on (as a bucket in another building or region would). moto copies the whole object for
each GET (61 ms per request on this 111 MB slide, 3.6 ms on a 1.9 MB one, measured here),
so its rows bound moto; the HTTP server reads only the range asked for. The model is the
near-free average-pooling program, so the figures are the read's: what a GPU that never
waits would see. Each job is `slidesnake embed` in a fresh process, as Snakemake runs
it; the S3 jobs find the server through AWS_ENDPOINT_URL, as a user of an S3-compatible
store would.

    python benchmarks/slides_in_place.py [--tiles 800] [--rounds 2] [--workers 2]
"""

from __future__ import annotations

import argparse
import http.client
import os
import sys
import tempfile
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from statistics import median
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from store_servers import S3_ENV, LoopbackServer, RangeServer, s3_server  # noqa: E402
from whole_job import near_free_model  # noqa: E402

from slidesnake.bench import embed_job, limit_tiles, synthetic_slide, tile_slide  # noqa: E402
from slidesnake.slides.synthetic import BENCH_SLIDES  # noqa: E402


class LatencyProxy(LoopbackServer):
    """An HTTP proxy to `upstream` that waits `latency_s` before passing each request on;
    requests are handled concurrently, so latency adds per request, not per job."""

    def __init__(self, upstream: str, latency_s: float) -> None:
        host = urlsplit(upstream).netloc
        local = threading.local()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                time.sleep(latency_s)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                if not hasattr(local, "connection"):
                    local.connection = http.client.HTTPConnection(host, timeout=60)
                local.connection.request(self.command, self.path, body, dict(self.headers))
                answer = local.connection.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                length = str(len(data))  # a HEAD's is the upstream's, for a body not sent
                for name, value in answer.getheaders():
                    if name.lower() == "content-length" and self.command == "HEAD":
                        length = value
                    elif name.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(name, value)
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = _forward

        super().__init__(Handler)


def job(slide, model: Path, workers: int, out: Path, endpoint: str | None) -> dict:
    """One whole embedding job; `endpoint`: the S3 server it reads the slide from."""
    if endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        return embed_job(
            slide, out, "--model", "custom", "--checkpoint", str(model),
            "--precision", "fp32", "--workers", str(workers),
        )  # fmt: skip
    finally:
        os.environ.pop("AWS_ENDPOINT_URL", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", type=int, default=800, help="the first N tiles of the slide")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "slidesnake-bench"
    )
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    os.environ.update(S3_ENV)
    model = near_free_model(args.cache)
    slide = synthetic_slide(args.cache, *BENCH_SLIDES["40x"][:2], mpp=0.25, dense=True)
    local = limit_tiles(tile_slide(slide, args.cache), args.tiles)
    latency = args.latency_ms / 1000
    with s3_server() as s3, tempfile.TemporaryDirectory() as served:
        web = RangeServer(Path(served))
        s3_slide = replace(local, path=s3.put("bench", slide.name, slide))
        web_path = urlsplit(web.add(slide)).path
        s3_far, web_far = LatencyProxy(s3.url, latency), LatencyProxy(web.url, latency)
        lag = f"+ {args.latency_ms:g} ms per request"
        places = {
            "local disk": (local, None),
            "S3 server (moto, loopback)": (s3_slide, s3.url),
            f"S3 server {lag}": (s3_slide, s3_far.url),
            "HTTP Range server (loopback)": (replace(local, path=web.url + web_path), None),
            f"HTTP Range server {lag}": (replace(local, path=web_far.url + web_path), None),
        }
        rounds = []
        for _ in range(args.rounds):
            out = args.cache / "in-place"
            rounds.append({name: job(tiled, model, args.workers, out, endpoint)
                           for name, (tiled, endpoint) in places.items()})  # fmt: skip
        for server in (s3_far, web_far, web):
            server.stop()
    report(rounds, slide.name, args)


def report(rounds: list[dict], slide: str, args) -> None:
    names = list(rounds[0])
    tiles = rounds[0][names[0]]["tiles"]
    print(f"{slide}, {tiles} tiles (224 px at 0.5 µm/px from 40x), near-free model, CPU, "
          f"{args.workers} loader workers, {args.rounds} rounds, medians; whole jobs, "
          "process start to last byte")  # fmt: skip
    print(f"  {'':<36} {'job s':>6} {'tiles/s':>8} {'x local':>8} {'loop t/s':>9} "
          f"{'MB read':>8} {'requests':>9}")  # fmt: skip
    base = median(r[names[0]]["process_s"] for r in rounds)
    for name in names:
        seconds = median(r[name]["process_s"] for r in rounds)
        loop = median(r[name]["tiles_per_s"] for r in rounds)
        last = rounds[-1][name]
        print(f"  {name:<36} {seconds:6.2f} {tiles / seconds:8.1f} {base / seconds:7.2f}x "
              f"{loop:9.1f} {last['bytes_read'] / 1e6:8.1f} {last['requests']:9d}")  # fmt: skip


if __name__ == "__main__":
    main()

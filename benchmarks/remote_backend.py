"""The remote backend against the local one: same model, same slide, same machine.

Starts `slidesnake serve` on the CPU with the demo model (timm:vit_tiny_patch16_224,
random weights, fp32) and runs `slidesnake embed` in a fresh process, as Snakemake runs a
job: once with the local backend (the baseline), then against the server with
max_concurrency 1, 2, 4 and 8. Per run: tiles/s over the whole job (process start to
metrics written) and over the loop, request latency, and the server's mean batch from
Triton's own metrics (tiles inferred / executions: what dynamic batching made of the
requests). Needs `make serve-env`.

    python benchmarks/remote_backend.py [--tiles 320] [--concurrency 1 2 4 8]
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from slidesnake.bench import embed_job, limit_tiles, synthetic_slide, tile_slide
from slidesnake.cli import SERVE_PYTHON
from slidesnake.slides.synthetic import BENCH_SLIDES

MODEL = "timm:vit_tiny_patch16_224"
PORTS = (18500, 18501, 18502)


def start_server(log: Path) -> subprocess.Popen:
    command = [
        str(SERVE_PYTHON), "-m", "slidesnake.serve", "--model", MODEL, "--weights", "random",
        "--precision", "fp32", "--device", "cpu", "--name", "demo", "--host", "127.0.0.1",
        "--http-port", str(PORTS[0]), "--grpc-port", str(PORTS[1]),
        "--metrics-port", str(PORTS[2]),
    ]  # fmt: skip
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    for _ in range(240):
        try:
            if httpx.get(f"http://127.0.0.1:{PORTS[0]}/v2/models/demo/ready").status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    server.kill()
    raise SystemExit(f"the server did not start; see {log}")


def server_counts() -> tuple[float, float]:
    """(tiles inferred, executions) of the served model so far, from Triton's metrics."""
    text = httpx.get(f"http://127.0.0.1:{PORTS[2]}/metrics").text

    def metric(name: str) -> float:
        found = re.search(rf'^{name}{{model="demo".*}} (\S+)$', text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    return metric("nv_inference_count"), metric("nv_inference_exec_count")


def job(slide, out: Path, *remote: str) -> dict:
    return embed_job(
        slide, out, "--model", MODEL, "--weights", "random", "--precision", "fp32",
        "--batch-size", "32", "--workers", "1", *remote,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", type=int, default=320, help="the first N tiles of the slide")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "slidesnake-bench"
    )
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    slide = synthetic_slide(args.cache, *BENCH_SLIDES["40x"][:2], mpp=0.25, dense=True)
    tiled = limit_tiles(tile_slide(slide, args.cache), args.tiles)
    local = job(tiled, args.cache / "remote-bench-local")
    server = start_server(args.cache / "remote-bench-server.log")
    rows = []
    try:
        for concurrency in args.concurrency:
            before = server_counts()
            url = ["--url", f"http://127.0.0.1:{PORTS[0]}", "--server-model", "demo"]
            metrics = job(tiled, args.cache / f"remote-bench-{concurrency}", *url,
                          "--max-concurrency", str(concurrency))  # fmt: skip
            after = server_counts()
            batch = (after[0] - before[0]) / max(after[1] - before[1], 1)
            rows.append((concurrency, metrics, batch))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    report(local, rows)


def report(local: dict, rows: list[tuple[int, dict, float]]) -> None:
    base = local["tiles"] / local["process_s"]
    print(f"{local['tiles']} tiles of the 40x bench slide, {MODEL} (random, fp32), CPU; "
          "requests of 32 tiles; the server on the same 2 cores")  # fmt: skip
    print(f"  {'':<34} {'job tiles/s':>11} {'x local':>8} {'loop':>7} {'p50 s':>7} "
          f"{'p99 s':>7} {'server batch':>12}")  # fmt: skip
    print(f"  {'local backend (baseline)':<34} {base:11.1f} {1:7.2f}x "
          f"{local['tiles_per_s']:7.1f}")  # fmt: skip
    for concurrency, m, batch in rows:
        whole = m["tiles"] / m["process_s"]
        print(f"  {f'remote, max_concurrency {concurrency}':<34} {whole:11.1f} "
              f"{whole / base:7.2f}x {m['tiles_per_s']:7.1f} {m['latency_p50_s']:7.3f} "
              f"{m['latency_p99_s']:7.3f} {batch:12.1f}")  # fmt: skip


if __name__ == "__main__":
    main()

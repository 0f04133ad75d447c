"""python -m slidesnake.serve: the server's command line (`slidesnake serve` runs it in the
server's environment)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from slidesnake.errors import SlidesnakeError
from slidesnake.serve import ensure_own_libpython

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def main(argv: Sequence[str] | None = None) -> None:
    ensure_own_libpython()
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    from slidesnake.serve.triton_server import ServeOptions, serve

    options = ServeOptions(**{k: v for k, v in vars(args).items() if v is not None})
    try:
        serve(options)
    except SlidesnakeError as err:
        logging.getLogger("slidesnake.serve").error("%s", err)
        sys.exit(1)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slidesnake serve",
        description="Serve an embedding model on one device through Triton Inference Server.",
    )
    parser.add_argument("--model", required=True, help="a model.name of the config")
    parser.add_argument("--checkpoint", help="weights file (as model.checkpoint)")
    parser.add_argument("--weights", choices=["checkpoint", "random"])
    parser.add_argument("--precision", choices=["fp16", "bf16", "fp32"])
    parser.add_argument("--mean", type=float, nargs=3)
    parser.add_argument("--std", type=float, nargs=3)
    parser.add_argument("--tile-size", type=int, help="default: the model's input size")
    parser.add_argument("--device", help="cuda:N (one server per GPU) or cpu; default cuda:0")
    parser.add_argument("--name", help="the model's name on the server (remote.model)")
    parser.add_argument("--host", help="address to listen on; default all")
    parser.add_argument("--http-port", type=int, help="default 8000 (remote.url's port)")
    parser.add_argument("--grpc-port", type=int, help="default 8001")
    parser.add_argument("--metrics-port", type=int, help="Prometheus metrics; default 8002")
    parser.add_argument("--max-batch", type=int, help="tiles per GPU batch; default 256")
    parser.add_argument("--queue-delay-us", type=int, help="batching wait; default 2000")
    return parser


if __name__ == "__main__":
    main()

"""One Markdown table from the JSON results of `slidesnake bench` runs (gpu_check.sh)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def row(path: Path) -> str:
    r = json.loads(path.read_text())
    job = r["end_to_end"]
    loaders = {int(k.split("_")[1]): v for k, v in r.items() if k.endswith("_workers")}
    shown = " / ".join(f"{loaders[w]:.0f}" for w in sorted(loaders))
    return (
        f"| {job['model']} {job['precision']} | {r['decode']} | {job['device_name']} "
        f"| {r['per_tile_baseline']:.0f} "
        f"| {shown} | {r['model_only']:.0f} | {job['tiles_per_s']:.0f} "
        f"({job['loader_workers']} workers, wait {100 * job['loader_wait_fraction']:.0f}%) "
        f"| {100 * job['model_busy_fraction']:.0f}% | {job['peak_device_mb']:.0f} |"
    )


def main() -> None:
    print("| model | decode | GPU | per-tile baseline | loader, per worker count | model only "
          "| whole job | GPU duty | peak GPU MB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for path in sys.argv[1:]:
        print(row(Path(path)))


if __name__ == "__main__":
    main()

"""A table from Nsight Compute's details CSV (``ncu --import R.ncu-rep --csv --page details``, as
scripts/device_ncu.sh writes it): a row a kernel launch, the metrics that say what bounds a small kernel.

    python scripts/ncu_summary.py ncu_r1.csv [--metrics "Duration,DRAM Throughput,..."]
"""

from __future__ import annotations

import argparse
import csv
import sys

DEFAULT = ("Duration", "DRAM Throughput", "Memory Throughput", "L1/TEX Hit Rate", "L2 Hit Rate", "Registers Per Thread",
           "Achieved Occupancy", "Waves Per SM", "Block Size", "Grid Size")


def rows(path: str) -> list[tuple[str, str, dict[str, str]]]:
    """(launch id, kernel name, {metric name: 'value unit'}) in launch order."""
    out: dict[str, tuple[str, dict[str, str]]] = {}
    try:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                if not r.get("ID") or "Metric Name" not in r:
                    continue
                name, m = out.setdefault(r["ID"], (r["Kernel Name"], {}))
                unit = r.get("Metric Unit") or ""
                m[r["Metric Name"]] = f"{r['Metric Value']} {unit}".strip()
                m.setdefault("Block Size", r.get("Block Size", ""))
                m.setdefault("Grid Size", r.get("Grid Size", ""))
    except OSError as err:
        sys.exit(f"ncu_summary: {path}: {err.strerror}")
    return [(i, n, m) for i, (n, m) in sorted(out.items(), key=lambda kv: int(kv[0]))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--metrics", default=",".join(DEFAULT), help="comma-separated metric names")
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.metrics.split(",") if n.strip()]
    table = rows(a.csv)
    if not table:
        sys.exit(f"ncu_summary: {a.csv}: no kernel rows (want ncu's --csv --page details output)")
    print("\t".join(["id", "kernel"] + names))
    for i, n, m in table:
        print("\t".join([i, n[:40]] + [m.get(k, "-") for k in names]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Prints one Markdown table from `rotary bench --workload` result JSONs.

    table.py RUN.txt A.json [B.json ...]

RUN.txt is what benches/peers/run.sh writes beside the results: the
machine, the pinned CPUs and one `SYSTEM: setting` line per system. Each
row is one result, named by its file (redis-always.json -> redis-always).

Throughput is the mean of the result's per-period `publishRate` (the
figure `rotary bench` prints as "Pub rate"); MB/s is that times
`messageSize`, in 10^6 bytes. Latencies are the whole-run aggregates
(`aggregatedPublishLatency*`, `aggregatedEndToEndLatency*`), in ms. The
durability column is the driver's own statement from the result
(`durability`); where a result has none, the setting from RUN.txt.
"""

import json
import os
import sys


def mean(values):
    values = [v for v in values if isinstance(v, (int, float))]
    return sum(values) / len(values) if values else float("nan")


def ms(value):
    if not isinstance(value, (int, float)):
        return "?"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def main(argv):
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    settings = {}
    header = []
    with open(argv[1]) as run:
        for line in run:
            line = line.rstrip("\n")
            name, sep, rest = line.partition(": ")
            if sep and not name.startswith(("date", "host", "revision", "workload", "servers")):
                settings.setdefault(name, rest)
            if line.startswith(("host:", "servers on", "workload:")):
                header.append(line)
    results = argv[2:]
    if not results:
        print("no results")
        return 1
    for line in header:
        print(line)
    print()
    print(
        "| system | msg/s | MB/s | publish p50 | p99 | p99.9 "
        "| end-to-end p50 | p99 | p99.9 | fsync and replication |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|---|")
    for path in results:
        with open(path) as f:
            r = json.load(f)
        name = os.path.splitext(os.path.basename(path))[0]
        rate = mean(r.get("publishRate", []))
        size = r.get("messageSize", 0)
        durability = r.get("durability") or settings.get(name, "?")
        cells = [
            name,
            f"{rate:,.0f}",
            f"{rate * size / 1e6:,.1f}",
            ms(r.get("aggregatedPublishLatency50pct")),
            ms(r.get("aggregatedPublishLatency99pct")),
            ms(r.get("aggregatedPublishLatency999pct")),
            ms(r.get("aggregatedEndToEndLatency50pct")),
            ms(r.get("aggregatedEndToEndLatency99pct")),
            ms(r.get("aggregatedEndToEndLatency999pct")),
            durability.replace("|", "/"),
        ]
        print("| " + " | ".join(cells) + " |")
    print()
    print("Latencies in ms; MB = 10^6 bytes; throughput = mean of the per-period publish rate.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

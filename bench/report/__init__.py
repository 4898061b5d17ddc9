"""Turns a run's results into the tables printed and written to ``docs/BENCHMARKS.md``.

- :mod:`bench.report.table`: labels, cells, Markdown tables, CPU share and per-unit cost;
- :mod:`bench.report.goals`: the performance targets, met or not;
- :mod:`bench.report.ratios`: ModelRelay ÷ its peers;
- :mod:`bench.report.sections`: (a) to (f);
- :mod:`bench.report.cluster`: (g) two processes through Redis, (h) per-key limits,
  (p) cluster mode on a Redis watched by Sentinel;
- :mod:`bench.report.batches`: (i) batches on idle capacity;
- :mod:`bench.report.classes`: (j) priority classes;
- :mod:`bench.report.affinity`: (k) cache-aware routing;
- :mod:`bench.report.fleet`: (l) fleet observability (tracing, federation);
- :mod:`bench.report.accesslog`: what the access log costs, from (a);
- :mod:`bench.report.ondemand`: (m) models on demand;
- :mod:`bench.report.speeds`: (n) speed-aware routing;
- :mod:`bench.report.resume`: (o) streams that survive a dropped connection;
- :mod:`bench.report.notes`: caveats and daphne against uvicorn;
- :mod:`bench.report.profiles`: the py-spy profiles;
- :mod:`bench.report.document`: the whole of ``docs/BENCHMARKS.md``.
"""

from __future__ import annotations

from typing import Any

from bench.report import (
    accesslog,
    affinity,
    batches,
    classes,
    cluster,
    fleet,
    goals,
    ondemand,
    ratios,
    resume,
    sections,
    speeds,
)

LEGEND = (
    "CPU columns are shares of one core over the measured window, from `/proc/<pid>/stat`: "
    "*target* is the process under test (ModelRelay's server process, LiteLLM, nginx); *rig* "
    "is the load generator, the fake upstream and ModelRelay's worker.py processes (which "
    "run on the GPU boxes in a deployment); *other* is everything else the machine ran "
    "meanwhile (other users' work), which perturbs the figures when it is large."
)


def tables(res: dict[str, Any]) -> str:
    parts = [
        [LEGEND, ""],
        goals.goals_table(res),
        ratios.ratios(res),
        sections.throughput(res),
        sections.latency(res),
        sections.streaming(res),
        sections.cpu(res),
        sections.memory(res),
        sections.big_box(res),
        cluster.cluster(res),
        cluster.limits(res),
        batches.batches(res),
        classes.classes(res),
        affinity.affinity(res),
        fleet.fleet(res),
        accesslog.access_log(res),
        ondemand.ondemand(res),
        speeds.speeds(res),
        resume.resume(res),
        cluster.failover(res),
    ]
    return "\n".join(line for part in parts for line in part)

"""A sweep's results as a table, sweep.json and sweep.png (throughput and p95 latency against the cap)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from sluice.worker.sweep import SweepRow

COLUMNS = ("max_num_seqs", "out tok/s", "req/s", "TTFT p50", "TTFT p95", "lat p50", "lat p95", "KV use", "preempt")


def table(rows: list[SweepRow]) -> str:
    cells = [[str(r.max_num_seqs), f"{r.output_tokens_per_s:.1f}", f"{r.requests_per_s:.2f}", f"{r.ttft_p50_s:.3f}s",
              f"{r.ttft_p95_s:.3f}s", f"{r.latency_p50_s:.3f}s", f"{r.latency_p95_s:.3f}s", f"{r.mean_kv_use:.0%}",
              str(r.num_preemptions)] for r in rows]
    widths = [max(len(c) for c in column) for column in zip(COLUMNS, *cells)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths))]
    for row, line in zip(rows, cells):
        lines.append("  ".join(c.rjust(w) for c, w in zip(line, widths)) + ("  <- knee" if row.knee else ""))
    return "\n".join(lines)


def write_json(path: Path, rows: list[SweepRow], about: dict) -> None:
    """One row per cap; `knee` is the knee's cap at the top level and a flag on each row."""
    knee = next(row.max_num_seqs for row in rows if row.knee)
    path.write_text(json.dumps({**about, "knee": knee, "rows": [asdict(row) for row in rows]}, indent=2) + "\n")


def plot(path: Path, rows: list[SweepRow]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    caps = [row.max_num_seqs for row in rows]
    knee = next(row.max_num_seqs for row in rows if row.knee)
    fig, throughput = plt.subplots(figsize=(7, 4.5), layout="constrained")
    throughput.plot(caps, [row.output_tokens_per_s for row in rows], "o-", color="tab:blue", label="output tokens/s")
    throughput.set_xscale("log", base=2)
    throughput.set_xticks(caps, [str(c) for c in caps])
    throughput.set_xlabel("max_num_seqs")
    throughput.set_ylabel("output tokens/s", color="tab:blue")
    throughput.axvline(knee, color="gray", linestyle=":", label=f"knee: {knee}")
    latency = throughput.twinx()
    latency.plot(caps, [row.latency_p95_s for row in rows], "s--", color="tab:red", label="p95 latency")
    latency.set_ylabel("p95 latency (s)", color="tab:red")
    fig.legend(loc="outside lower center", ncols=3)  # below the axes: never over a point
    fig.suptitle("Throughput and p95 latency against batch size")
    fig.savefig(path, dpi=100)
    plt.close(fig)

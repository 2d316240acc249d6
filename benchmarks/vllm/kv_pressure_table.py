"""KV pressure on the real engine: FCFS and Feather side by side per cell
(``benchmarks/vllm/kv_pressure.sh``).

    .venv/bin/python benchmarks/vllm/kv_pressure_table.py CHAT.json CONVERSATIONS.json ...

One row per cell and scheduler: the median (range over rounds) of mean and p99 TTFT,
output tok/s, preemptions (total, and the most on one request), and the mean and p99
TTFT and output tok/s as per-round ratios to ``fcfs`` (issue 58: no loss under KV pressure, so
feather-model's TTFT ratio <= 1 and its preemptions not a multiple of FCFS's).
"""

from __future__ import annotations

from feather_sched.bench.study import markdown_table, ratios, result_files
from feather_sched.results.summary import median_and_range

BASE = "fcfs"
FIGURES = [("mean TTFT s", "mean_ttft_ms", 1e-3, "{:.2f}"),
           ("p99 TTFT s", "p99_ttft_ms", 1e-3, "{:.2f}"),
           ("output tok/s", "output_throughput", 1.0, "{:.1f}"),
           ("preemptions", "preemptions", 1.0, "{:.0f}"),
           ("max on one request", "max_preemptions_per_request", 1.0, "{:.0f}")]
RATIOS = [("mean TTFT / fcfs", "mean_ttft_ms"), ("p99 TTFT / fcfs", "p99_ttft_ms"),
          ("tok/s / fcfs", "output_throughput")]


def main() -> None:
    rows = []
    for path, runs in result_files(__doc__):
        for name, sample in runs.items():
            cells = [median_and_range([run[key] * scale for run in sample], fmt)
                     for _, key, scale, fmt in FIGURES]
            cells += [median_and_range(ratios(sample, runs[BASE], key), "{:.2f}", "x")
                      if BASE in runs else "" for _, key in RATIOS]
            rows.append([path.stem, name, str(len(sample)), *cells])
    print(markdown_table(["cell", "scheduler", "rounds", *(t for t, *_ in FIGURES),
                          *(t for t, _ in RATIOS)], rows))


if __name__ == "__main__":
    main()

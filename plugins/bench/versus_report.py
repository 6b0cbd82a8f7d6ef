"""The versus bench's numbers and tables (plugins.bench.versus): pure functions of its result rows.

A row is one aiperf run against one server: {"workload", "server", "rate" (Poisson runs), "requests",
"isl", "osl", "concurrency", "prefix", and the METRICS keys, "errors"}.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# row key -> (aiperf's profile_export_aiperf.json metric, statistic)
METRICS = {"output_tok_s": ("output_token_throughput", "avg"), "ttft_p50_ms": ("time_to_first_token", "p50"),
           "ttft_p99_ms": ("time_to_first_token", "p99"), "itl_p50_ms": ("inter_token_latency", "p50"),
           "itl_p99_ms": ("inter_token_latency", "p99"), "completed": ("completed_request_count", "avg")}
COLUMNS = ("workload", "server", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
           "completed", "errors", "read GB/s before, after")
GOODPUT_COLUMNS = ("server", "goodput req/s", "output tok/s at goodput", "TTFT p99 ms by rate (req/s)")
PREFILL_COLUMNS = ("server", "prompt tokens", "served prompt tok/s (aiperf)", "served prompt tok/s (/metrics)",
                   "offline prompt tok/s", "served / offline (aiperf)", "served / offline (/metrics)")
LATENCIES = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def summary_row(data: dict) -> dict:
    """aiperf's profile_export_aiperf.json -> the row's metrics."""
    row = {key: data.get(metric, {}).get(stat) for key, (metric, stat) in METRICS.items()}
    count = data.get("request_count", {}).get("avg") or 0
    row["errors"] = int(round((data.get("request_error_rate", {}).get("avg") or 0) * count / 100))
    if data.get("error_request_count"):
        row["errors"] = max(row["errors"], int(data["error_request_count"].get("avg") or 0))
    return row


def label(row: dict) -> str:
    w = row["workload"]
    shape = f"{row['requests']} x ({row['isl']} + {row['osl']})"
    if w == "poisson":
        return f"Poisson {row['rate']:g} req/s, {shape}"
    if w == "prefix":
        return f"{row['requests']} x ({row['prefix']} shared prefix + {row['isl']}, {row['osl']} out), " \
               f"{row['concurrency']} concurrent"
    return f"{w}: {row['concurrency']} concurrent, {shape}"


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _read(row: dict) -> str:
    """The machine's read bandwidth just before and after the run: it swings up to 2x within minutes on
    these VMs, so two servers' rows are comparable only where they ran at similar readings."""
    return ", ".join(format(x, ".1f") for x in row["read_gbs"]) if row.get("read_gbs") else "-"


def results_table(rows: list[dict]) -> list[str]:
    """One line per workload and server, then ours / vLLM where both ran it: tok/s ours / theirs;
    latencies "Nx lower" (theirs / ours) or "Nx HIGHER" (ours / theirs)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    groups: dict[str, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault(label(r), {})[r["server"]] = r
    for name, by_server in groups.items():
        for server, r in by_server.items():
            lines.append(f"| {name} | {server} | {_num(r['output_tok_s'], '.1f')} | "
                         + " | ".join(_num(r[k], ".0f") for k in LATENCIES)
                         + f" | {_num(r['completed'], '.0f')} | {r['errors']} | {_read(r)} |")
        if {"ours", "vllm"} <= by_server.keys():
            ours, theirs = by_server["ours"], by_server["vllm"]
            tok = (f"{ours['output_tok_s'] / theirs['output_tok_s']:.2f}x"
                   if ours["output_tok_s"] and theirs["output_tok_s"] else "-")
            lat = [("-" if not (ours[k] and theirs[k]) else f"{theirs[k] / ours[k]:.2f}x lower"
                    if theirs[k] >= ours[k] else f"{ours[k] / theirs[k]:.2f}x HIGHER") for k in LATENCIES]
            lines.append(f"| {name} | ours / vLLM | {tok} | " + " | ".join(lat) + " | | | |")
    return lines


def goodput_rate(rows: list[dict], bound_ms: float) -> float | None:
    """The highest swept Poisson rate at which that rate and every lower one finished every request with
    no error and a TTFT p99 within `bound_ms` (a server that misses the bound at 0.5 req/s does not get
    credit for a lucky 0.75). None: not even the lowest rate."""
    best = None
    for r in sorted(rows, key=lambda r: r["rate"]):
        ok = (r["errors"] == 0 and r["completed"] is not None and r["completed"] >= r["requests"]
              and r["ttft_p99_ms"] is not None and r["ttft_p99_ms"] <= bound_ms)
        if not ok:
            break
        best = r["rate"]
    return best


def goodput(rows: list[dict], bound_s: float) -> dict:
    """server -> {"rate": goodput req/s or None, "output_tok_s": at that rate, "ttft_p99_ms": {rate: p99}}."""
    out = {}
    for server in dict.fromkeys(r["server"] for r in rows if r["workload"] == "poisson"):
        sweep = sorted((r for r in rows if r["workload"] == "poisson" and r["server"] == server),
                       key=lambda r: r["rate"])
        rate = goodput_rate(sweep, bound_s * 1000)
        at = next((r for r in sweep if r["rate"] == rate), None)
        out[server] = {"rate": rate, "output_tok_s": at["output_tok_s"] if at else None,
                       "ttft_p99_ms": {f"{r['rate']:g}": r["ttft_p99_ms"] for r in sweep},
                       "output_tok_s_by_rate": {f"{r['rate']:g}": r["output_tok_s"] for r in sweep}}
    return out


def goodput_table(good: dict, bound_s: float) -> list[str]:
    lines = [f"Goodput: the highest swept rate at which it and every lower rate keep TTFT p99 <= {bound_s:g} s "
             "with no errors.", "", "| " + " | ".join(GOODPUT_COLUMNS) + " |", "|" + "---|" * len(GOODPUT_COLUMNS)]
    for server, g in good.items():
        by_rate = ", ".join(f"{rate}: {_num(p99, '.0f')}" for rate, p99 in g["ttft_p99_ms"].items())
        rate = "none (misses the bound at the lowest rate)" if g["rate"] is None else f"{g['rate']:g}"
        lines.append(f"| {server} | {rate} | {_num(g['output_tok_s'], '.1f')} | {by_rate} |")
    return lines


# --- served prefill efficiency ----------------------------------------------------------------------

def _value(metric):
    return metric.get("value") if isinstance(metric, dict) else metric


def read_records(path: Path) -> list[dict]:
    """aiperf's profile_export.jsonl -> [{"start_s", "ttft_s", "isl"}] of the profiling phase's requests
    that got a first token (warm-up and failed requests left out)."""
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        meta, metrics = rec.get("metadata", {}), rec.get("metrics", {})
        if str(meta.get("benchmark_phase", "profiling")).lower() != "profiling" or rec.get("error"):
            continue
        ttft, isl = _value(metrics.get("time_to_first_token")), _value(metrics.get("input_sequence_length"))
        if ttft is None or isl is None:
            continue
        out.append({"start_s": meta["request_start_ns"] / 1e9, "ttft_s": ttft / 1000, "isl": isl})
    return out


def served_prefill(records: list[dict]) -> dict:
    """Prompt tokens over the time some request waited for its first token (the union of every request's
    [sent, first token] interval): the prompt rate the server sustained while it had prompts to prefill,
    decode steps of other requests in that time included."""
    spans = sorted((r["start_s"], r["start_s"] + r["ttft_s"]) for r in records)
    busy, end = 0.0, None
    for a, b in spans:
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    tokens = sum(r["isl"] for r in records)
    return {"prompt_tokens": tokens, "requests": len(records), "prefill_busy_s": busy,
            "prompt_tok_s": tokens / busy if busy > 0 else None}


def metric_values(text: str, names) -> dict:
    """Prometheus text -> {series (name plus labels as written): value} for the series of `names`."""
    out = {}
    for m in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$", text, re.MULTILINE):
        if m.group(1) in names:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


OURS_PREFILL_SERIES = ("mqa_prefill_tokens_total", "mqa_step_seconds_sum")
VLLM_PREFILL_SERIES = ("vllm:prompt_tokens_total", "vllm:request_prefill_time_seconds_sum",
                       "vllm:request_prefill_kv_computed_tokens_sum")


def metrics_prefill(before: dict, after: dict) -> dict:
    """Server-side prompt rate over a workload, from /metrics scraped before and after it.
    Ours: prompt tokens computed / seconds of the engine steps that computed prompt tokens (phase
    prefill, and mixed: prompt chunks in a decode step's forward). vLLM exports no step times: its figure
    is per request (prompt tokens computed / summed per-request prefill time), recorded, not compared."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}

    def total(name: str, labels: str = "") -> float | None:  # summed over label sets unless given
        found = [x for k, x in d.items() if k == name + labels or (not labels and k.startswith(name + "{"))]
        return sum(found) if found else None

    if "mqa_prefill_tokens_total" in d:
        tokens = d["mqa_prefill_tokens_total"]
        secs = sum(total("mqa_step_seconds_sum", f'{{phase="{p}"}}') or 0.0 for p in ("prefill", "mixed"))
        return {"source": "engine steps", "prompt_tokens": tokens, "step_s": secs,
                "prompt_tok_s": tokens / secs if secs > 0 else None}
    tokens = total("vllm:request_prefill_kv_computed_tokens_sum")
    tokens = total("vllm:prompt_tokens_total") if tokens is None else tokens
    secs = total("vllm:request_prefill_time_seconds_sum")
    if tokens is None or not secs:
        return {}
    return {"source": "per request", "prompt_tokens": tokens, "request_prefill_s": secs,
            "per_request_prompt_tok_s": tokens / secs}


def prefill_table(prefill: dict, offline: dict | None) -> list[str]:
    """prefill: server -> {"served": served_prefill(...), "metrics": metrics_prefill(...)}; offline: the
    offline prefill (plugins.bench.versus_offline's JSON), or None."""
    off = offline.get("prompt_tok_s") if offline else None
    lines = ["| " + " | ".join(PREFILL_COLUMNS) + " |", "|" + "---|" * len(PREFILL_COLUMNS)]
    for server, p in prefill.items():
        served, metric = p.get("served") or {}, p.get("metrics") or {}
        rate, engine = served.get("prompt_tok_s"), metric.get("prompt_tok_s")
        ratios = [f"{x / off:.2f}" if x and off else "-" for x in (rate, engine)]
        lines.append(f"| {server} | {_num(served.get('prompt_tokens'), '.0f')} | {_num(rate, '.0f')} | "
                     f"{_num(engine, '.0f')} | {_num(off, '.0f')} | " + " | ".join(ratios) + " |")
    return lines

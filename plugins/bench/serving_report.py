"""The serving benchmark's reports: a markdown table per phase, server vs static ratios, the latency
vs load plot and the console summary (`plugins.bench.serving` measures)."""

from __future__ import annotations

from pathlib import Path


def _ms(value) -> str:
    return "—" if value is None else f"{value * 1e3:.1f}"


def _num(value, spec=".2f") -> str:
    return "—" if value is None else format(value, spec)


def _table(header, rows) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows] + [""]


LOAD_HEADER = ["requests", "errors", "tokens (requested)", "wall s", "tokens/s", "req/s", "TTFT p50 ms",
               "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "latency p50 s", "latency p99 s", "tokens / engine step"]


def _load_cells(p: dict) -> list:
    return [p["requests"], p["errors"], f"{p['tokens']} ({p['tokens_requested']})", _num(p["wall_s"], ".1f"),
            _num(p["throughput_tok_s"], ".1f"), _num(p["req_per_s"], ".3f"), _ms(p["ttft_p50_s"]),
            _ms(p["ttft_p99_s"]), _ms(p["itl_p50_s"]), _ms(p["itl_p99_s"]), _num(p["latency_p50_s"]),
            _num(p["latency_p99_s"]), _num(p["tokens_per_step"], ".1f")]


def ratios(result: dict) -> dict:
    ph, static = result["phases"], result["phases"].get("static")
    if not static:
        return {}
    return {"mixed_server_over_static": ph["mixed"]["throughput_tok_s"] / static["useful_tok_s"],
            "concurrent_server_over_static_decode": ph["concurrent"]["throughput_tok_s"]
            / static["decode"]["decode_tok_s"],
            "concurrent_server_over_static_end_to_end": ph["concurrent"]["throughput_tok_s"]
            / static["decode"]["end_to_end_tok_s"]}


def write_markdown(path: Path, result: dict) -> None:
    cfg, srv, ph, env = result["config"], result["server"], result["phases"], result["machine"]
    health = srv.get("health") or {}
    lines = [f"# Serving benchmark: {result['model']} ({result['timestamp']})", "",
             f"Server: {srv['url']} ({'started here' if srv['started'] else 'given with --url: settings may differ'}), "
             "backend "
             f"{cfg['backend']}, {cfg['dtype']}, tp {cfg['tp']}; KV pool {health.get('slots', '?')} slots x "
             f"{health.get('capacity', '?')} tokens = {health.get('kv_pool_bytes', 0) / 2**20:.0f} MiB per rank. "
             f"Machine: {env['cpu']}, {env['cpu_count']} CPUs, {env['torch_threads']} torch threads.", "",
             f"Requests: greedy, real-code prompts of {cfg['prompt_len']} tokens (re-encoded: "
             f"{result['prompt_tokens']['min']}-{result['prompt_tokens']['max']}), streamed (SSE). TTFT: send to "
             "first text chunk; ITL: gap between consecutive text chunks of a request; tokens: the server's usage "
             "counts. Tokens / engine step (from /metrics): the mean running batch.", ""]
    lines += [f"## Concurrent: {min(cfg['streams'], cfg['requests'])} closed-loop streams, "
              f"{cfg['stream_tokens']} tokens each", ""]
    lines += _table(LOAD_HEADER, [_load_cells(ph["concurrent"])])
    lines += [f"## Open loop: Poisson arrivals, max_tokens uniform in {cfg['max_tokens'][0]}..{cfg['max_tokens'][1]}",
              ""]
    lines += _table(["offered req/s"] + LOAD_HEADER, [[_num(p["rate"], "g")] + _load_cells(p) for p in ph["open_loop"]])
    lines += ["## Mixed: the open loop's request set, all sent at once", ""]
    lines += _table(LOAD_HEADER, [_load_cells(ph["mixed"])])
    static = ph.get("static")
    if static:
        d = static["decode"]
        lines += [f"## Static batches: `generate` in process, batches of {static['batch_size']}, each to its "
                  "longest request", ""]
        lines += _table(["batch", "size", "max_new_tokens", "useful tokens", "generated tokens", "wall s", "prefill s",
                         "mean step ms"],
                        [[i, b["size"], b["max_new_tokens"], b["useful_tokens"], b["generated_tokens"],
                          _num(b["wall_s"]), _num(b["prefill_s"], ".3f"), _ms(b["mean_step_s"])]
                         for i, b in enumerate(static["batches"])])
        lines += [f"Useful tokens (each request's own max_tokens): {static['useful_tokens']} of "
                  f"{static['generated_tokens']} generated, {static['useful_tok_s']:.1f} useful tokens/s. "
                  f"Decode batch {d['batch_size']} x {d['new_tokens']} tokens: mean step {d['mean_step_s'] * 1e3:.1f} "
                  f"ms = {d['decode_tok_s']:.1f} tokens/s decode only, {d['end_to_end_tok_s']:.1f} tokens/s with "
                  "prefill.", ""]
        r = result["ratios"]
        lines += ["## Server vs static", ""]
        lines += _table(["comparison", "server tokens/s", "static tokens/s", "server / static"], [
            ["mixed set: continuous batching vs static batches (useful tokens)",
             _num(ph["mixed"]["throughput_tok_s"], ".1f"), _num(static["useful_tok_s"], ".1f"),
             f"{r['mixed_server_over_static']:.2f}x"],
            [f"concurrent {cfg['streams']} streams vs static batch {d['batch_size']}, decode only "
             "(streams / mean step)",
             _num(ph["concurrent"]["throughput_tok_s"], ".1f"), _num(d["decode_tok_s"], ".1f"),
             f"{r['concurrent_server_over_static_decode']:.2f}x"],
            [f"concurrent {cfg['streams']} streams vs static batch {d['batch_size']}, with prefill",
             _num(ph["concurrent"]["throughput_tok_s"], ".1f"), _num(d["end_to_end_tok_s"], ".1f"),
             f"{r['concurrent_server_over_static_end_to_end']:.2f}x"]])
        slots = health.get("slots")
        if slots and slots > static["batch_size"]:
            lines += [f"The server has {slots} slots: in the mixed phase it may run more than {static['batch_size']} "
                      "requests at once (see tokens / engine step), static batches never do.", ""]
    short = [(name, p) for name, p in [("concurrent", ph["concurrent"]), ("mixed", ph["mixed"])]
             + [(f"open loop {p['rate']:g} req/s", p) for p in ph["open_loop"]] if p["tokens"] < p["tokens_requested"]]
    if short:
        lines += ["Early stops: the server ends a request at EOS (static `generate` never does): "
                  + "; ".join(f"{name} {p['tokens']} of {p['tokens_requested']} tokens" for name, p in short) + ".",
                  ""]
    path.write_text("\n".join(lines))


def write_plot(path: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    points = sorted(result["phases"]["open_loop"], key=lambda p: p["rate"])
    rates = [p["rate"] for p in points]
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(13, 4.8))
    for key, label, colour, style in (("ttft_p50_s", "TTFT p50", "tab:blue", "-"),
                                      ("ttft_p99_s", "TTFT p99", "tab:blue", "--"),
                                      ("itl_p50_s", "ITL p50", "tab:orange", "-"),
                                      ("itl_p99_s", "ITL p99", "tab:orange", "--")):
        pts = [(x, p[key] * 1e3) for x, p in zip(rates, points) if p[key] is not None]
        lat.plot([a for a, _ in pts], [b for _, b in pts], style, marker="o", color=colour, label=label)
    lat.set(xlabel="offered load (requests/s, Poisson)", ylabel="ms", title="Latency vs load")
    thr.plot(rates, [p["throughput_tok_s"] for p in points], "-", marker="o", color="tab:green",
             label="open loop tokens/s")
    thr.axhline(result["phases"]["concurrent"]["throughput_tok_s"], color="grey", linestyle=":",
                label=f"concurrent ({result['config']['streams']} closed streams)")
    thr.set(xlabel="offered load (requests/s, Poisson)", ylabel="generated tokens/s", title="Throughput vs load")
    for ax in (lat, thr):
        ax.set_xlim(left=0, right=max(rates) * 1.1)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.suptitle(f"{result['model']}: {result['config']['backend']} {result['config']['dtype']}, "
                 f"{result['config']['requests']} requests per rate", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def summary(result: dict, out: Path) -> list[str]:
    ph = result["phases"]

    def line(name, p):
        return (f"  {name:<24} {p['throughput_tok_s']:8.1f} tok/s  {p['req_per_s']:6.3f} req/s  TTFT p50/p99 "
                f"{_ms(p['ttft_p50_s'])}/{_ms(p['ttft_p99_s'])} ms  ITL p50/p99 {_ms(p['itl_p50_s'])}/"
                f"{_ms(p['itl_p99_s'])} ms  errors {p['errors']}")

    lines = [f"serving benchmark: {result['model']} ({result['config']['backend']}, {result['config']['dtype']})",
             line("concurrent", ph["concurrent"])]
    lines += [line(f"open loop {p['rate']:g} req/s", p) for p in ph["open_loop"]]
    lines.append(line("mixed (all at once)", ph["mixed"]))
    if ph.get("static"):
        s, r = ph["static"], result["ratios"]
        lines += [f"  static batches of {s['batch_size']}: {s['useful_tok_s']:.1f} useful tok/s -> server / static "
                  f"{r['mixed_server_over_static']:.2f}x on the mixed set",
                  f"  static decode bs {s['decode']['batch_size']}: {s['decode']['decode_tok_s']:.1f} tok/s -> "
                  f"concurrent server / static decode {r['concurrent_server_over_static_decode']:.2f}x"]
    return lines + [f"wrote {out}"]

"""What a person reads after `scripts/compare.py`: results.md tables and PNG plots."""

from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

MB = 2 ** 20
GB = 1e9


def _fmt(value, spec=".1f", scale=1.0):
    if value is None:
        return "—"
    return format(value / scale, spec)


def _table(header, rows) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return lines + [""]


# The factor within which the roofline, fed this machine's probes, predicts its measured decode steps
# (small / santacoder shapes, 2 CPU cores: measured 4-10x; per-step framework overhead and GEMV kernels
# that stream weights at about half the probe's bandwidth make up the gap).
PREDICTION_FACTOR = 10.0


def ratio_summary(rows) -> dict | None:
    ratios = [r["measured_over_predicted"] for r in rows if not r.get("error")]
    if not ratios:
        return None
    return {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios),
            "factor": PREDICTION_FACTOR, "within_factor": sum(1 <= x <= PREDICTION_FACTOR for x in ratios),
            "rows": len(ratios)}


def mqa_mha_pairs(rows) -> list[tuple]:
    """(backend, batch, prompt, MQA row, MHA row) for models that differ only in attention."""
    by_key = {}
    for r in rows:
        if not r.get("error"):
            by_key.setdefault((r["backend"], r["batch"], r["prompt_len"]), {}).setdefault(r["attention"], r)
    return [(k[0], k[1], k[2], v["MQA"], v["MHA"]) for k, v in sorted(by_key.items()) if len(v) == 2]


def projection_markdown(proj_rows, batches) -> list[str]:
    if not proj_rows:
        return []
    out = []
    for hw in dict.fromkeys(r["hardware"] for r in proj_rows):
        for model in dict.fromkeys(r["model"] for r in proj_rows if r["hardware"] == hw):
            rows = [r for r in proj_rows if r["hardware"] == hw and r["model"] == model]
            ctx = rows[0]["context"]
            nbytes = rows[0]["dtype_bytes"]
            out += [f"### Projection: {model} on {hw} (context {ctx}, {nbytes}-byte weights and KV)", ""]
            header = ["attn", "TP", "KV layout", "weights GB/rank", f"max batch @ {ctx}", "max KV tokens",
                      f"prefill ms (B=1, {ctx})"]
            for b in batches:
                header += [f"decode ms/token B={b}", f"MFU % B={b}", f"KV GB/rank B={b}"]
            table = []
            for r in rows:
                cells = [r["attention"], r["tp"], r["kv_layout"], _fmt(r["weight_bytes_per_rank"], ".2f", GB),
                         r["max_batch"], f"{r['max_kv_tokens']:,}", _fmt(r["prefill_ms"])]
                for b in batches:
                    d = r["decode"][b]
                    fits = "" if d["fits"] else " (no fit)"
                    cells += [_fmt(d["ms"], ".2f") + fits, _fmt(d["mfu_pct"]), _fmt(d["kv_bytes_per_rank"], ".2f", GB)]
                table.append(cells)
            out += _table(header, table)
    out += ["KV layout `head`: KV split by head over the TP ranks (MQA's single head replicated on every rank); "
            "`batch`: each rank keeps every KV head of B/TP sequences (Pope et al. 2022). Time per step = "
            "max(bytes / bandwidth, FLOPs / peak) + TP all-reduces; activations and workspace are not counted "
            "in the memory fit.", ""]
    return out


def write_markdown(path: Path, result: dict) -> None:
    env, machine, cfg = result["environment"], result["machine"], result["config"]
    rows = result["rows"]
    ok = [r for r in rows if not r.get("error")]
    v = env["versions"]
    lines = [f"# Comparison: {cfg['name'] or 'custom'} ({result['timestamp']})", "",
             f"Models {', '.join(m['label'] for m in cfg['models'])}; dtype {cfg['dtype']}; "
             f"batch sizes {cfg['batch_sizes']}; prompt lengths {cfg['prompt_lengths']}; "
             f"{cfg['new_tokens']} new tokens; warmup {cfg['warmup']}, cycles {cfg['cycles']}.", "",
             f"Machine: {env['cuda'] or env['cpu']}, {env['cpu_count']} CPUs, {env['torch_threads']} torch threads, "
             f"{env['ram_bytes'] / 2**30:.0f} GiB RAM. torch {v['torch']}, transformers {v['transformers']}, "
             f"deepspeed {v['deepspeed']}, megatron-core {v['megatron-core']}.", "",
             f"Measured at start: read bandwidth **{machine['mem_bw'] / GB:.1f} GB/s**, "
             f"{machine['gemm_dtype']} GEMM peak **{machine['peak_flops'] / GB:.1f} GFLOP/s** "
             "(the roofline's two figures); "
             f"a batch-1 {machine['gemm_dtype']} `F.linear` streams weights at {machine['gemv_bw'] / GB:.1f} GB/s.", ""]
    probe = env.get("cpu_kernels")
    if probe:
        forced = f" (forced by PLUGINS_KERNELS={probe['forced']})" if probe["forced"] else ""
        lines += [f"CPU linears (plugins.kernels): rung **{probe['rung']}**{forced}; bf16 by rows "
                  f"{probe['bf16']}, int8 by rows {probe['int8']}.", ""]
    if result["skipped"]:
        lines += ["Skipped backends:", ""]
        lines += [f"- {s['backend']} ({s['model']}): {s['reason']}" for s in result["skipped"]]
        lines.append("")

    lines += ["## Speed and memory", ""]
    lines += _table(
        ["model", "backend", "B", "T", "linears decode / prefill", "load s", "prefill ms", "decode ms p50", "p90",
         "tok/s", "read GB/s", "peak MB", "KV MB (theory)", "tokenize ms", "detok ms"],
        [[r["model"], r["backend"], r["batch"], r["prompt_len"],
          "{decode} / {prefill}".format(**r["linear_paths"]) + (" (slow dtype here)" if r.get("warning") else ""),
          _fmt(r["load_s"], ".2f"), _fmt(r["prefill_ms"]),
          _fmt(r["decode_ms_median"], ".2f"), _fmt(r["decode_ms_p90"], ".2f"), _fmt(r["tokens_per_s"]),
          _fmt(r.get("read_bw"), ".1f", GB),
          _fmt(r["peak_mem_bytes"], ".0f", MB),
          f"{_fmt(r['kv_bytes'], '.2f', MB)} ({_fmt(r['kv_bytes_theory'], '.2f', MB)})",
          _fmt(r["tokenize_ms"], ".2f"), _fmt(r["detokenize_ms"], ".2f")] for r in ok])

    lines += ["## Correctness (vs HF, same weights, same prompts) and roofline", ""]
    lines += _table(
        ["model", "backend", "B", "T", "greedy agree %", "max abs logit diff", "mem ms", "compute ms",
         "predicted ms", "measured / predicted", "MBU %", "MFU %", "prefill MFU %"],
        [[r["model"], r["backend"], r["batch"], r["prompt_len"], _fmt(r["token_agreement_pct"]),
          _fmt(r["max_logit_diff"], ".2e"), _fmt(r["mem_ms"], ".2f"), _fmt(r["compute_ms"], ".2f"),
          _fmt(r["predicted_decode_ms"], ".2f"), _fmt(r["measured_over_predicted"], ".2f"),
          _fmt(r["mbu_pct"]), _fmt(r["mfu_pct"]), _fmt(r["prefill_mfu_pct"])] for r in ok])
    summary = ratio_summary(rows)
    if summary:
        lines += [f"Roofline prediction of the decode step on this machine (Pope et al. 2022, fed the measured "
                  f"bandwidth and GEMM peak): measured / predicted = {summary['min']:.2f} .. {summary['max']:.2f} "
                  f"(median {summary['median']:.2f}); {summary['within_factor']} of {summary['rows']} rows within "
                  f"the stated factor 1..{summary['factor']:.0f}x. The gap is what the engines leave on the table "
                  f"(framework overhead per step, GEMV kernels below stream bandwidth).", ""]

    pairs = mqa_mha_pairs(rows)
    if pairs:
        lines += ["## MQA vs MHA", ""]
        lines += _table(
            ["backend", "B", "T", "decode ms MQA", "decode ms MHA", "MHA / MQA", "KV MB MQA", "KV MB MHA",
             "peak MB MQA", "peak MB MHA"],
            [[b, bs, t, _fmt(q["decode_ms_median"], ".2f"), _fmt(h["decode_ms_median"], ".2f"),
              _fmt(h["decode_ms_median"] / q["decode_ms_median"], ".2f"), _fmt(q["kv_bytes"], ".2f", MB),
              _fmt(h["kv_bytes"], ".2f", MB), _fmt(q["peak_mem_bytes"], ".0f", MB),
              _fmt(h["peak_mem_bytes"], ".0f", MB)] for b, bs, t, q, h in pairs])

    errors = [r for r in rows if r.get("error")]
    if errors:
        lines += ["## Failures (recorded, run went on)", ""]
        lines += _table(["model", "backend", "B", "T", "error"],
                        [[r["model"], r["backend"], r["batch"], r["prompt_len"], r["error"].replace("|", "/")]
                         for r in errors])
    lines += projection_markdown(result.get("projection"), cfg["project_batches"])
    lines += ["Columns: linears = the implementation of the decode step's and the prefill's linear layers "
              "(plugins.kernels: avx512 / avx2 = our kernels, onednn = oneDNN-packed bf16, fp32 = fp32 GEMM on "
              "converted weights, torch = the engine's own torch calls); "
              "load s = backend load from the HF checkpoint (per backend); prefill ms = prompt forward + "
              "first token (median over cycles); decode ms = one new token for the whole batch (median and p90 over "
              "all steps of all cycles); tok/s = B x new tokens / (prefill + decode); read GB/s = read bandwidth probed "
              "just before the row's timed runs (the roofline uses the one at the start); peak MB = peak RSS of this "
              "process and its TP workers during the row (max allocated on CUDA); KV MB = cache bytes one rank holds "
              "after generation, theory 2 x layers x B x (T + new - 1) x KV heads x head dim x bytes; greedy agree % "
              "= new tokens equal to HF's; max abs logit diff over the first "
              f"{cfg['logit_batch']} prompts of the row; mem / compute ms = per-step bytes / measured bandwidth and "
              "FLOPs / measured GEMM peak; predicted = max(mem, compute) + comm; MBU / MFU = achieved fraction of "
              "bandwidth / GEMM peak at the measured step time.", ""]
    path.write_text("\n".join(lines))


def _lines(ax, rows, x, y, group, scale=1.0):
    groups = {}
    for r in rows:
        if not r.get("error") and r.get(y) is not None:
            groups.setdefault(group(r), []).append((r[x], r[y] / scale))
    for label, pts in sorted(groups.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    if groups:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def _batch_axis(ax, rows):
    """Log-scaled batch axis labelled with the batch sizes actually run (1, 8, ... not 10^0)."""
    sizes = sorted({r["batch"] for r in rows})
    ax.set_xscale("log")
    ax.minorticks_off()
    if sizes:
        ax.set_xticks(sizes, [str(b) for b in sizes])


def _figure(models, title):
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    fig.suptitle(title)
    return fig, axes[0]


def write_plots(out_dir: Path, rows, new_tokens: int) -> list[str]:
    models = list(dict.fromkeys(r["model"] for r in rows)) or ["(none)"]
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(name)

    fig, axes = _figure(models, "Decode ms/step vs batch size")
    for ax, m in zip(axes, models):
        _lines(ax, [r for r in rows if r["model"] == m], "batch", "decode_ms_median",
               lambda r: f"{r['backend']} T={r['prompt_len']}")
        ax.set(title=m, xlabel="batch size", ylabel="decode ms / step")
        _batch_axis(ax, rows)
    save(fig, "decode_vs_batch.png")

    fig, axes = _figure(models, "Per-token latency vs key length")
    for ax, m in zip(axes, models):
        sub = [{**r, "key_len": r["prompt_len"] + new_tokens // 2} for r in rows if r["model"] == m]
        _lines(ax, sub, "key_len", "decode_ms_median", lambda r: f"{r['backend']} B={r['batch']}")
        ax.set(title=m, xlabel="key length (prompt + new/2)", ylabel="decode ms / step")
    save(fig, "latency_vs_context.png")

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    fig.suptitle("MQA vs MHA (largest prompt length)")
    longest = max((r["prompt_len"] for r in rows), default=0)
    sub = [r for r in rows if r["prompt_len"] == longest]
    _lines(axes[0], sub, "batch", "decode_ms_median", lambda r: f"{r['backend']} {r['attention']} ({r['model']})")
    axes[0].set(xlabel="batch size", ylabel="decode ms / step")
    _lines(axes[1], sub, "batch", "kv_bytes", lambda r: f"{r['backend']} {r['attention']} ({r['model']})", MB)
    axes[1].set(xlabel="batch size", ylabel="KV cache MB (per rank)")
    for ax in axes:
        _batch_axis(ax, rows)
    save(fig, "mqa_vs_mha.png")

    fig, axes = _figure(models, "Peak memory (RSS incl. TP workers; CUDA: max allocated), largest prompt length")
    for ax, m in zip(axes, models):
        _lines(ax, [r for r in sub if r["model"] == m], "batch", "peak_mem_bytes", lambda r: r["backend"], MB)
        ax.set(title=m, xlabel="batch size", ylabel="peak MB")
        _batch_axis(ax, rows)
    save(fig, "memory.png")
    return written

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
    note = noise_note(result.get("noise"))
    if note:
        lines += [f"**{note[0].upper() + note[1:]}.**", ""]
    probe = env.get("cpu_kernels")
    if probe:
        forced = f" (forced by PLUGINS_KERNELS={probe['forced']})" if probe["forced"] else ""
        choices = (f"{probe['table']} choices; bf16 by rows {probe['bf16']}, int8 by rows {probe['int8']}"
                   if "bf16" in probe else probe["table"])
        lines += [f"CPU linears (plugins.kernels): rung **{probe['rung']}**{forced}, {choices}.", ""]
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

    lines += quality_markdown(ok)
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
              "all steps of all cycles); tok/s = B x new tokens / (prefill + decode); "
              "read GB/s = read bandwidth probed "
              "just before the row's timed runs (the roofline uses the one at the start); peak MB = peak RSS of this "
              "process and its TP workers during the row (max allocated on CUDA); KV MB = cache bytes one rank holds "
              "after generation, theory 2 x layers x B x (T + new - 1) x KV heads x head dim x bytes; greedy agree % "
              "= new tokens equal to HF's; max abs logit diff over the first "
              f"{cfg['logit_batch']} prompts of the row; mem / compute ms = per-step bytes / measured bandwidth and "
              "FLOPs / measured GEMM peak; predicted = max(mem, compute) + comm; MBU / MFU = achieved fraction of "
              "bandwidth / GEMM peak at the measured step time.", ""]
    path.write_text("\n".join(lines))


def quality_markdown(ok) -> list[str]:
    """Held-out perplexity (bench config `perplexity`), greedy agreement with the reference and the
    speculative rows' acceptance, one line per row; nothing when the run measured none of them."""
    quality = [r for r in ok if "heldout_ppl" in r or "perplexity_error" in r or (r.get("stats") or {}).get("rounds")]
    if not quality:
        return []
    table = []
    for r in quality:
        stats = r.get("stats") or {}
        accept = stats.get("acceptance_rate")
        ppl = _fmt(r.get("heldout_ppl"), ".2f") if "perplexity_error" not in r else "failed"
        table.append([r["model"], r["backend"], r.get("dtype", "—"), r["batch"], r["prompt_len"], ppl,
                      _fmt(r.get("heldout_nll"), ".3f"), _fmt(r["token_agreement_pct"]),
                      _fmt(None if accept is None else 100 * accept), _fmt(stats.get("tokens_per_round"), ".2f")])
    lines = ["## Quality (held-out perplexity, agreement with the reference, speculative acceptance)", ""]
    lines += _table(["model", "backend", "dtype", "B", "T", "held-out ppl", "NLL nats", "greedy agree %",
                     "spec accept %", "tokens / round"], table)
    return lines + ["Held-out ppl = exp(mean next-token NLL) over the same fixed windows of held-out stdlib "
                    "files (never trained on), teacher-forced through each backend's `logits`; greedy agree % "
                    "= new tokens equal to the reference row's (the first HF row, fp32 when there is one); "
                    "spec accept % = drafted tokens the target kept, tokens / round = tokens per target forward.",
                    ""]


# --- noise and the console summary ----------------------------------------------------------------

NOISE_SHARE = 0.25  # rows whose read-bandwidth probes differ by more than this are flagged


def noise(rows, machine) -> dict:
    """How much the machine's read bandwidth moved during the run (each row probes it before timing)."""
    bws = [r["read_bw"] for r in rows if not r.get("error") and r.get("read_bw")] + [machine["mem_bw"]]
    low, high = min(bws), max(bws)
    spread = high / low - 1
    return {"read_bw_min": low, "read_bw_max": high, "spread": spread, "noisy": spread > NOISE_SHARE,
            "threshold": NOISE_SHARE}


def noise_note(n: dict) -> str:
    if not n or not n["noisy"]:
        return ""
    return (f"noisy machine: read bandwidth moved {n['read_bw_min'] / GB:.0f}-{n['read_bw_max'] / GB:.0f} GB/s "
            f"during the run (more than {n['threshold']:.0%}); compare close rows with care")


def summary(result: dict, out: Path) -> list[str]:
    """A few lines for the console: where the results are, the headline ratios against HF, correctness."""
    rows = result["rows"]
    ok = [r for r in rows if not r.get("error")]
    lines = [f"results: {out / 'results.md'} (tables), results.json, {len(result.get('plots', []))} plots",
             f"rows: {len(ok)} ok, {len(rows) - len(ok)} failed"
             + (f"; skipped: {', '.join(s['backend'] for s in result['skipped'])}" if result["skipped"] else "")]
    for model in dict.fromkeys(r["model"] for r in ok):
        mine = [r for r in ok if r["model"] == model]
        prompt = max(r["prompt_len"] for r in mine)
        batches = sorted({r["batch"] for r in mine})
        # the reference row: the first HF one at TP 1 (rows come in run order, the reference first)
        hf = next((r["backend"] for r in mine if r.get("backend_name", r["backend"]) == "hf"
                   and r.get("tp_size", 1) == 1), "hf")
        ref = {r["batch"]: r["decode_ms_median"] for r in mine if r["backend"] == hf and r["prompt_len"] == prompt}
        lines.append(f"{model} ({result['config']['dtype']}, prompt {prompt}): decode ms/step at B = "
                     f"{' / '.join(map(str, batches))}, and speed-up vs {hf}")
        for backend in dict.fromkeys(r["backend"] for r in mine):
            by_b = {r["batch"]: r for r in mine if r["backend"] == backend and r["prompt_len"] == prompt}
            ms = " / ".join(_fmt(by_b[b]["decode_ms_median"]) if b in by_b else "-" for b in batches)
            x = " / ".join(f"{ref[b] / by_b[b]['decode_ms_median']:.2f}x" if b in by_b and b in ref else "-"
                           for b in batches)
            lines.append(f"  {backend:<28} {ms:>20}   {x}")
    # rows meant to be exact: fp32 and not quantized (bf16 / int8 rows are there to show their cost)
    bad = [r for r in ok if r.get("token_agreement_pct") is not None and r["backend"] != "hf"
           and r.get("dtype", result["config"]["dtype"]) == "float32" and not (r.get("options") or {}).get("quantize")
           and (r["token_agreement_pct"] < 100 or (r["max_logit_diff"] or 0) > 1e-5)]
    if result["config"]["dtype"] == "float32":
        lines.append("correctness: every row matches HF (max |logit diff| <= 1e-5, greedy tokens identical)"
                     if not bad else f"correctness: {len(bad)} row(s) differ from HF beyond 1e-5 (see results.md)")
    if result.get("prediction"):
        p = result["prediction"]
        lines.append(f"roofline: measured / predicted decode step {p['min']:.1f}-{p['max']:.1f}x "
                     f"(median {p['median']:.1f}x)")
    note = noise_note(result.get("noise"))
    if note:
        lines.append(note)
    return lines


# --- plots ---------------------------------------------------------------------------------------

STYLES = {"MQA": "-", "MHA": "--"}


def _colours(rows) -> dict:
    """One colour per backend, the same in every plot; HF (the reference) black."""
    names = [b for b in dict.fromkeys(r["backend"] for r in rows) if b != "hf"]
    cmap = plt.get_cmap("tab10")
    return {"hf": "black", **{b: cmap(i % 10) for i, b in enumerate(names)}}


def _series(ax, rows, x, y, colours, label_model=False, scale=1.0, band=None):
    """One line per (backend, attention): colour = backend, line style = attention; `band`: the key of
    an upper value (p90) shaded above the line."""
    groups = {}
    for r in rows:
        if not r.get("error") and r.get(y) is not None:
            groups.setdefault((r["backend"], r["attention"], r["model"] if label_model else ""), []).append(r)
    for (backend, attention, model), pts in sorted(groups.items()):
        pts.sort(key=lambda r: r[x])
        xs, ys = [p[x] for p in pts], [p[y] / scale for p in pts]
        ref = backend == "hf"
        label = f"{backend} {attention}" + (" (reference)" if ref else "") + (f" {model}" if model else "")
        ax.plot(xs, ys, STYLES.get(attention, "-"), marker="o", color=colours[backend], label=label,
                linewidth=2.5 if ref else 1.5)
        if band:
            ax.fill_between(xs, ys, [p[band] / scale for p in pts], color=colours[backend], alpha=0.12, linewidth=0)
    ax.grid(alpha=0.3)


def _legend(ax):
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _batch_axis(ax, rows):
    """Log-scaled batch axis labelled with the batch sizes actually run (1, 8, ... not 10^0)."""
    sizes = sorted({r["batch"] for r in rows})
    ax.set_xscale("log")
    ax.minorticks_off()
    if sizes:
        ax.set_xticks(sizes, [str(b) for b in sizes])


def write_plots(out_dir: Path, rows, new_tokens: int, noise_info: dict | None = None) -> list[str]:
    ok = [r for r in rows if not r.get("error")]
    colours = _colours(ok)
    note = noise_note(noise_info)
    written = []

    def save(fig, name, title):
        fig.suptitle(title + (f"\n{note}" if note else ""), fontsize=11)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(name)

    prompts = sorted({r["prompt_len"] for r in ok}) or [0]
    fig, axes = plt.subplots(1, len(prompts), figsize=(6.5 * len(prompts), 4.8), squeeze=False)
    for ax, t in zip(axes[0], prompts):
        _series(ax, [r for r in ok if r["prompt_len"] == t], "batch", "decode_ms_median", colours,
                band="decode_ms_p90")
        ax.set(title=f"prompt {t} tokens", xlabel="batch size", ylabel="decode ms / step (line p50, band to p90)")
        ax.set_ylim(bottom=0)
        _batch_axis(ax, ok)
    _legend(axes[0][-1])
    save(fig, "decode_vs_batch.png", "Decode step time vs batch (colour = backend, solid = MQA, dashed = MHA)")

    batches = sorted({r["batch"] for r in ok}) or [0]
    fig, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 4.8), squeeze=False)
    for ax, b in zip(axes[0], batches):
        sub = [{**r, "key_len": r["prompt_len"] + new_tokens // 2} for r in ok if r["batch"] == b]
        _series(ax, sub, "key_len", "decode_ms_median", colours)
        ax.set(title=f"batch {b}", xlabel="key length (prompt + new / 2)", ylabel="decode ms / step")
        ax.set_ylim(bottom=0)
    _legend(axes[0][-1])
    save(fig, "latency_vs_context.png", "Per-token latency vs key length (colour = backend, solid = MQA, dashed = MHA)")

    longest = max(prompts)
    sub = [r for r in ok if r["prompt_len"] == longest]
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
    _series(axes[0], sub, "batch", "decode_ms_median", colours)
    axes[0].set(xlabel="batch size", ylabel="decode ms / step")
    _series(axes[1], sub, "batch", "kv_bytes", colours, scale=MB)
    axes[1].set(xlabel="batch size", ylabel="KV cache MB (per rank)")
    pairs = mqa_mha_pairs(sub)
    for backend in dict.fromkeys(p[0] for p in pairs):
        pts = sorted((b, h["decode_ms_median"] / q["decode_ms_median"]) for be, b, _, q, h in pairs if be == backend)
        axes[2].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colours[backend], label=backend,
                     linewidth=2.5 if backend == "hf" else 1.5)
    axes[2].axhline(1.0, color="grey", linewidth=0.8)
    axes[2].set(xlabel="batch size", ylabel="MHA / MQA decode time (> 1: MQA faster)")
    for ax in axes:
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        _batch_axis(ax, sub)
    _legend(axes[1])
    _legend(axes[2])
    save(fig, "mqa_vs_mha.png", f"MQA vs MHA at prompt {longest} tokens (colour = backend, solid = MQA, dashed = MHA)")

    biggest = max(batches)
    sub = [r for r in ok if r["prompt_len"] == longest and r["batch"] == biggest]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(sub) + 2), 4.8))
    labels, weights, kv, other = [], [], [], []
    for r in sub:
        ranks = r.get("tp_size", 1)
        w = r["weight_bytes_per_rank"] * ranks / MB
        k = r["kv_bytes"] * ranks / MB
        labels.append(f"{r['backend'].replace(' ', chr(10))}\n{r['attention']}")  # "deepspeed-autotp tp2": 2 lines
        weights.append(w), kv.append(k), other.append(max(0.0, r["peak_mem_bytes"] / MB - w - k))
    xs = range(len(labels))
    ax.bar(xs, weights, color="#4c72b0", label="weights (all ranks)")
    ax.bar(xs, kv, bottom=weights, color="#dd8452", label="KV cache (all ranks, measured)")
    ax.bar(xs, other, bottom=[a + b for a, b in zip(weights, kv)], color="#bbbbbb",
           label="everything else (runtime, activations, workers)")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set(ylabel="peak MB (CPU: peak RSS incl. TP workers)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3, axis="y")
    _legend(ax)
    save(fig, "memory.png", f"Peak memory at batch {biggest}, prompt {longest}: what it holds")
    return written

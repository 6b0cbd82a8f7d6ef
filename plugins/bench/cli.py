"""Benchmark every backend on the same weights: speed, memory, correctness against HF, roofline.
Run as `mqa-compare`, `python -m plugins.bench` or `scripts/compare.py`.

  mqa-compare                                   # configs/bench/default.yaml (what `make compare` runs)
  mqa-compare santacoder-1b                     # configs/bench/santacoder-1b.yaml (the real shape)
  mqa-compare my.yaml --out results/mine --profile   # + torch.profiler traces per backend
  mqa-compare --project h100-80gb h200          # analytical projection only (starcoder-15b)
  mqa-compare --project cpu-measured --project-model santacoder-1b --context 512

Writes results/<timestamp>/{results.json, results.md, *.png} (and projection.md / projection.json with
--project) and prints a short summary. See the README section "Comparing backends" for the columns.
"""

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path


def local_hardware(dtype):
    from plugins.bench import probes, roofline

    measured = probes.measure_machine(dtype)
    return roofline.load_hardware("cpu-measured", measured), measured


def describe_probes(measured: dict) -> str:
    return (f"read bandwidth {measured['mem_bw'] / 1e9:.1f} GB/s, {measured['gemm_dtype']} GEMM "
            f"{measured['peak_flops'] / 1e9:.1f} GFLOP/s (linears: {measured.get('gemm_path', 'torch')})")


def projection(names, models, context, batches, dtype, measured=None) -> list[dict]:
    import torch

    from plugins.bench import roofline
    from plugins.core.console import announce

    rows = []
    for name in names:
        if name == "cpu-measured" and measured is None:
            announce("measuring this machine for the cpu-measured projection (~10 s)...")
            _, measured = local_hardware(dtype)
            announce(f"cpu-measured: {describe_probes(measured)}")
        hw = roofline.load_hardware(name, measured)
        dtype_bytes = torch.empty((), dtype=dtype).element_size()
        rows += roofline.project(models, hw, context, batches, dtype_bytes)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default="default", help="bench config name in configs/bench/ or a YAML path")
    ap.add_argument("--out", type=Path, help="output dir (default results/<timestamp>)")
    ap.add_argument("--profile", action="store_true", help="write torch.profiler traces per backend")
    ap.add_argument("--project", nargs="+", metavar="HARDWARE",
                    help="only the analytical projection, on hardware specs in configs/hardware/ "
                         "(a100-80gb, h100-80gb, h200, cpu-measured)")
    ap.add_argument("--project-model", nargs="+", default=["starcoder-15b"], help="model configs to project")
    ap.add_argument("--context", type=int, default=2048, help="projection: prompt / KV length")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="projection: batch sizes")
    ap.add_argument("--dtype", default="bfloat16", help="projection: weight and KV dtype")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    from plugins.core.console import announce, exit_without_collecting, quiet_upstream

    quiet_upstream()
    exit_without_collecting()
    from plugins.bench import config as bench_config
    from plugins.bench import grid, probes, report, roofline
    from plugins.core.config import REPO_ROOT, ConfigError, load_model_config
    from plugins.core.tensors import resolve_dtype, storage_dtype

    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or REPO_ROOT / "results" / stamp
    try:
        if args.project:
            # Everything is checked before any work.
            for name in args.project:
                roofline.read_hardware_spec(name)
            for name in args.project_model:
                load_model_config(name)
            if args.context < 1 or min(args.batch) < 1:
                raise ConfigError("--context and --batch must be positive")
            dtype = storage_dtype(args.dtype)  # a projection computes nothing here
            rows = projection(args.project, args.project_model, args.context, args.batch, dtype)
            text = "\n".join(report.projection_markdown(rows, args.batch))
            out.mkdir(parents=True, exist_ok=True)
            (out / "projection.json").write_text(json.dumps(rows, indent=1))
            (out / "projection.md").write_text(text)
            print(text)
            print(f"wrote {out}/projection.md")
            return 0
        cfg = bench_config.load_bench_config(args.config)
    except ConfigError as exc:
        ap.error(str(exc))

    dtype = resolve_dtype(cfg.dtype)
    announce("measuring the machine (read bandwidth, GEMM peak; ~10 s)...")
    local_hw, measured = local_hardware(dtype)
    announce(f"measured: {describe_probes(measured)}")
    out.mkdir(parents=True, exist_ok=True)
    rows, skipped = grid.run_grid(cfg, local_hw, out, profile=args.profile, progress=not args.no_progress)
    proj = projection(cfg.project, cfg.project_models, cfg.project_context, cfg.project_batches,
                      storage_dtype("bfloat16"), measured) if cfg.project else []
    result = {"timestamp": stamp, "config": asdict(cfg), "environment": probes.environment(dtype),
              "machine": measured, "skipped": skipped, "rows": rows, "projection": proj,
              "prediction": report.ratio_summary(rows), "noise": report.noise(rows, measured)}
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    report.write_markdown(out / "results.md", result)
    result["plots"] = report.write_plots(out, rows, cfg.new_tokens, result["noise"])
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    print("\n".join(report.summary(result, out)))
    if rows and all(r.get("error") for r in rows):
        print("error: every row failed (see results.md, section Failures)", file=sys.stderr)
        return 1
    return 0

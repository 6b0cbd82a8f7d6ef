"""The versus bench's pure parts (plugins.bench.versus, versus_deploy, versus_report), no server started:
argument parsing and the aiperf runs it plans, vLLM's deployment as its CPU docs say (preloads found in a
fake library directory, a missing one named with its install command, the OpenMP binding), the goodput
rate from per-rate results, served prefill from aiperf records and /metrics, and the report's columns."""

import json
import os

import pytest

from plugins.bench import versus, versus_deploy as deploy, versus_report as report

CKPT = "/tmp/mqa/santacoder-1b"


def args_for(*extra):
    return versus.parse_args([CKPT, "--aiperf", ".venv-aiperf/bin/aiperf", *extra])


# --- arguments and the plan -------------------------------------------------------------------------

def test_defaults_run_every_workload_and_sweep_four_rates():
    a = args_for()
    assert a.workloads == ["streams", "poisson", "prefix", "prefill"] and a.rates == [0.25, 0.5, 0.75, 1.0]
    assert a.ttft_bound_s == 5.0 and not a.quick and a.vllm_python is None
    loads = versus.loads(a)
    assert loads["streams"] == versus.Load(32, 128, 128, concurrency=16)          # two waves
    assert loads["streams"].requests >= 2 * loads["streams"].concurrency
    assert loads["poisson"] == versus.Load(32, 128, 128)
    assert loads["prefill"] == versus.Load(16, 1024, 64, concurrency=8)
    assert loads["prefix"].prefix == 1024
    assert [(w, r) for w, r, _ in versus.runs(a)] == [("streams", None), ("poisson", 0.25), ("poisson", 0.5),
                                                        ("poisson", 0.75), ("poisson", 1.0), ("prefix", None),
                                                        ("prefill", None)]


def test_each_workload_is_one_group_of_runs_a_fresh_server_start_serves():
    groups = versus.workload_groups(versus.runs(args_for()))
    assert [[(w, r) for w, r, _ in g] for g in groups] == [
        [("streams", None)], [("poisson", 0.25), ("poisson", 0.5), ("poisson", 0.75), ("poisson", 1.0)],
        [("prefix", None)], [("prefill", None)]]


def test_quick_makes_every_workload_smaller_and_keeps_two_waves():
    a = args_for("--quick")
    assert a.rates == [0.5, 1.0]
    for w, (full, quick) in versus.WORKLOADS.items():
        assert quick.requests * quick.isl * quick.osl < full.requests * full.isl * full.osl, w
    assert versus.loads(a)["streams"].requests >= 2 * versus.loads(a)["streams"].concurrency
    assert args_for("--quick", "--rates", "2").rates == [2.0]


def test_workloads_are_selectable_and_seeds_do_not_depend_on_the_selection():
    every = {(w, r): s for w, r, s in versus.runs(args_for())}
    some = versus.runs(args_for("--workloads", "prefill", "poisson", "--rates", "0.5"))
    assert [(w, r) for w, r, _ in some] == [("poisson", 0.5), ("prefill", None)]   # fixed order
    assert all(every[(w, r)] == s for w, r, s in some)
    assert len(set(every.values())) == len(every)                                  # no two runs share prompts
    with pytest.raises(SystemExit):
        args_for("--workloads", "nonsense")
    with pytest.raises(SystemExit):
        args_for("--rates", "0")


def test_aiperf_arguments_per_kind_of_load():
    closed = versus.aiperf_args(versus.Load(32, 128, 128, concurrency=16), None, 1)
    assert closed == ["--random-seed", "1", "--request-count", "32", "--isl", "128", "--osl", "128",
                      "--concurrency", "16", "--request-rate-mode", "constant", "--request-rate", "200"]
    poisson = versus.aiperf_args(versus.Load(32, 128, 128), 0.75, 1750)
    assert poisson[-4:] == ["--request-rate-mode", "poisson", "--request-rate", "0.75"]
    assert "--concurrency" not in poisson
    prefix = versus.aiperf_args(versus.Load(8, 32, 32, concurrency=8, prefix=1024), None, 2)
    assert prefix[-4:] == ["--num-prefix-prompts", "1", "--prefix-prompt-length", "1024"]


# --- vLLM's deployment ------------------------------------------------------------------------------

@pytest.fixture
def fake_install(tmp_path):
    libdir = tmp_path / "usr-lib"
    libdir.mkdir()
    (libdir / "libtcmalloc_minimal.so.4").write_bytes(b"")
    venv = tmp_path / ".venv-vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    os.symlink("/usr/bin/python3", venv / "bin" / "python")  # a venv's python links to the base one
    return libdir, venv


def test_vllm_runs_with_the_docs_preloads_binding_kv_space_and_prefix_caching(fake_install):
    libdir, venv = fake_install
    a = args_for("--vllm-python", str(venv / "bin" / "python"), "--tcmalloc-dirs", str(libdir), "--vllm-kv-gib", "6",
                 "--vllm-args", "--block-size", "32")
    cmd, env = versus.vllm_deployment(a, "santacoder-1b", 8123, {"prefix_caching_flag": True},
                                      base_env={"PATH": "/bin", "LD_PRELOAD": "/opt/mine.so"}, affinity={0, 1},
                                      siblings_of=lambda c: [c])
    assert env["LD_PRELOAD"] == f"{libdir}/libtcmalloc_minimal.so.4:{venv}/lib/libiomp5.so:/opt/mine.so"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "6"
    assert env["PATH"] == "/bin"
    assert cmd[:3] == [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enable-prefix-caching" in cmd and cmd[-2:] == ["--block-size", "32"]
    assert cmd[cmd.index("--port") + 1] == "8123" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[cmd.index("--max-num-seqs") + 1] == "16"
    no_flag, _ = versus.vllm_deployment(a, "m", 1, {"prefix_caching_flag": False}, base_env={}, affinity={0},
                                        siblings_of=lambda c: [c])
    assert "--enable-prefix-caching" not in no_flag
    shown = deploy.recorded_env(env)
    assert set(shown) == {"LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"}


def test_a_missing_preload_library_fails_naming_its_install_command(fake_install, tmp_path):
    libdir, venv = fake_install
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(deploy.PreloadMissing, match="apt-get install -y libtcmalloc-minimal4"):
        deploy.find_tcmalloc([empty])
    (venv / "lib" / "libiomp5.so").unlink()
    with pytest.raises(deploy.PreloadMissing, match=r"\.venv-vllm/bin/pip install intel-openmp"):
        deploy.find_iomp(venv)
    a = args_for("--vllm-python", str(venv / "bin" / "python"), "--tcmalloc-dirs", str(libdir))
    with pytest.raises(deploy.PreloadMissing):
        versus.vllm_deployment(a, "m", 1, {}, base_env={}, affinity={0}, siblings_of=lambda c: [c])


def test_iomp_is_also_found_deeper_in_the_venv_and_tcmalloc_by_its_other_name(tmp_path):
    deep = tmp_path / "v" / "lib" / "python3.11" / "site-packages" / "intel"
    deep.mkdir(parents=True)
    (deep / "libiomp5.so").write_bytes(b"")
    assert deploy.find_iomp(tmp_path / "v") == deep / "libiomp5.so"
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    assert deploy.find_tcmalloc([tmp_path]) == tmp_path / "libtcmalloc.so.4"
    assert deploy.venv_root(tmp_path / "v" / "bin" / "python") == tmp_path / "v"


def test_the_openmp_binding_takes_one_cpu_per_physical_core():
    assert deploy.cpu_list([1, 0]) == "0-1"
    assert deploy.cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert deploy.parse_cpu_list("0-2,5") == [0, 1, 2, 5]
    pairs = {0: [0, 4], 4: [0, 4], 1: [1, 5], 5: [1, 5], 2: [2, 6], 6: [2, 6]}
    assert deploy.physical_cpus({0, 1, 2, 4, 5, 6}, pairs.get) == [0, 1, 2]
    assert deploy.physical_cpus({4, 5}, pairs.get) == [4, 5]  # a sibling outside the affinity does not count


# --- goodput and the report -------------------------------------------------------------------------

def row(server, rate, p99_ms, errors=0, completed=32, workload="poisson", tok_s=50.0):
    return {"workload": workload, "server": server, "rate": rate, "requests": 32, "isl": 128, "osl": 128,
            "concurrency": None, "prefix": 0, "output_tok_s": tok_s, "ttft_p50_ms": p99_ms / 2, "ttft_p99_ms": p99_ms,
            "itl_p50_ms": 100.0, "itl_p99_ms": 120.0, "completed": completed, "errors": errors}


def test_goodput_is_the_highest_rate_with_every_lower_rate_within_the_bound():
    sweep = [row("ours", 0.25, 400), row("ours", 0.5, 900), row("ours", 0.75, 4800), row("ours", 1.0, 12000)]
    assert report.goodput_rate(sweep, 5000) == 0.75
    assert report.goodput_rate(list(reversed(sweep)), 5000) == 0.75       # order of the rows does not matter
    assert report.goodput_rate(sweep, 20000) == 1.0
    assert report.goodput_rate(sweep, 300) is None
    lucky = [row("v", 0.25, 400), row("v", 0.5, 6000), row("v", 0.75, 4000)]
    assert report.goodput_rate(lucky, 5000) == 0.25                        # no credit past a miss
    assert report.goodput_rate([row("v", 0.25, 400, errors=1)], 5000) is None
    assert report.goodput_rate([row("v", 0.25, 400, completed=31)], 5000) is None


def test_goodput_per_server_and_its_table():
    rows = [row("ours", 0.5, 900, tok_s=60), row("ours", 1.0, 7000), row("vllm", 0.5, 6000), row("vllm", 1.0, 9000),
            row("ours", None, 20000, workload="streams")]
    good = report.goodput(rows, 5.0)
    assert good["ours"]["rate"] == 0.5 and good["ours"]["output_tok_s"] == 60
    assert good["ours"]["ttft_p99_ms"] == {"0.5": 900, "1": 7000}
    assert good["vllm"]["rate"] is None and good["vllm"]["output_tok_s"] is None
    table = report.goodput_table(good, 5.0)
    assert "| " + " | ".join(report.GOODPUT_COLUMNS) + " |" in table
    assert any(ln.startswith("| vllm | none") for ln in table) and any(ln.startswith("| ours | 0.5 |") for ln in table)


def test_results_table_has_every_column_and_a_ratio_row_per_workload():
    rows = [row("ours", None, 2000, workload="streams", tok_s=60),
            row("vllm", None, 1000, workload="streams", tok_s=40), row("ours", 0.5, 500), row("vllm", 0.5, 1000)]
    for r in rows[:2]:
        r["concurrency"] = 16
    rows[0]["read_gbs"] = [22.71, 19.04]
    lines = report.results_table(rows)
    assert lines[0] == "| " + " | ".join(report.COLUMNS) + " |" and len(report.COLUMNS) == 10
    assert lines[2].endswith("| 22.7, 19.0 |") and lines[3].endswith("| - |")
    assert all(ln.count("|") == len(report.COLUMNS) + 1 for ln in lines)
    ratios = [ln for ln in lines if "ours / vLLM" in ln]
    assert len(ratios) == 2 and "1.50x" in ratios[0] and "2.00x HIGHER" in ratios[0] and "2.00x lower" in ratios[1]


def test_summary_row_reads_aiperf_export_and_counts_errors():
    data = {"output_token_throughput": {"avg": 42.0}, "time_to_first_token": {"p50": 10.0, "p99": 20.0},
            "inter_token_latency": {"p50": 1.0, "p99": 2.0}, "completed_request_count": {"avg": 15},
            "request_count": {"avg": 16}, "request_error_rate": {"avg": 6.25}}
    r = report.summary_row(data)
    assert r == {"output_tok_s": 42.0, "ttft_p50_ms": 10.0, "ttft_p99_ms": 20.0, "itl_p50_ms": 1.0, "itl_p99_ms": 2.0,
                 "completed": 15, "errors": 1}


def test_served_prefill_from_aiperf_records(tmp_path):
    def rec(start_s, ttft_ms, isl, phase="profiling", error=None):
        return json.dumps({"metadata": {"request_start_ns": int(start_s * 1e9), "benchmark_phase": phase},
                           "metrics": {"time_to_first_token": {"value": ttft_ms, "unit": "ms"},
                                       "input_sequence_length": {"value": isl, "unit": "tokens"}}, "error": error})
    path = tmp_path / "profile_export.jsonl"
    path.write_text("\n".join([rec(0, 2000, 1024), rec(1, 3000, 1024), rec(10, 1000, 1024),   # busy 4 s + 1 s
                              rec(0, 50, 999, phase="warmup"), rec(0, 50, 999, error={"code": 500})]) + "\n")
    records = report.read_records(path)
    assert len(records) == 3
    served = report.served_prefill(records)
    assert served["prompt_tokens"] == 3072 and served["prefill_busy_s"] == pytest.approx(5.0)
    assert served["prompt_tok_s"] == pytest.approx(3072 / 5)


def test_metrics_prefill_ours_from_step_times_vllm_per_request():
    ours0 = report.metric_values('mqa_prefill_tokens_total 100.0\nmqa_step_seconds_sum{phase="prefill"} 1.0\n'
                                 'mqa_step_seconds_sum{phase="decode"} 5.0\nmqa_step_seconds_sum{phase="mixed"} 1.0\n',
                                 report.OURS_PREFILL_SERIES)
    ours1 = report.metric_values('mqa_prefill_tokens_total 8292.0\nmqa_step_seconds_sum{phase="prefill"} 3.0\n'
                                 'mqa_step_seconds_sum{phase="decode"} 9.0\nmqa_step_seconds_sum{phase="mixed"} 3.0\n'
                                 'mqa_prompt_tokens_total 9999\n', report.OURS_PREFILL_SERIES)
    got = report.metrics_prefill(ours0, ours1)
    assert got["prompt_tokens"] == 8192 and got["step_s"] == 4.0 and got["prompt_tok_s"] == 2048
    lab = '{engine="0",model_name="m"}'
    v0 = report.metric_values(f"vllm:prompt_tokens_total{lab} 10\nvllm:request_prefill_time_seconds_sum{lab} 1\n",
                              report.VLLM_PREFILL_SERIES)
    v1 = report.metric_values(f"vllm:prompt_tokens_total{lab} 1034\nvllm:request_prefill_time_seconds_sum{lab} 3\n",
                              report.VLLM_PREFILL_SERIES)
    got = report.metrics_prefill(v0, v1)
    assert got["source"] == "per request" and got["per_request_prompt_tok_s"] == 512 and "prompt_tok_s" not in got
    assert report.metrics_prefill({}, {}) == {}


def test_the_markdown_report_records_versions_deployments_and_every_table():
    a = args_for("--quick")
    rows = [row("ours", 0.5, 900), row("vllm", 0.5, 1900), row("ours", None, 3000, workload="prefill"),
            row("vllm", None, 2000, workload="prefill")]
    for r in rows[2:]:
        r.update(concurrency=8, requests=16, isl=1024, osl=64)
    state = {"machine": {"cpus": [0, 1], "cpu": "Xeon", "isa": ["amx_bf16"], "mem_gib": 23.4, "tree": "abc123"},
             "versions": {"ours": {"torch": "2.13.0"}, "aiperf": {"aiperf": "0.13.0"},
                          "vllm": {"vllm": "0.32.0", "torch": "2.13.0+cpu"}},
             "servers": {"ours": {"cmd": ["python", "-m", "plugins.http"], "env": {}},
                         "vllm": {"cmd": ["py", "-m", "vllm.entrypoints.openai.api_server", "--enable-prefix-caching"],
                                  "env": {"LD_PRELOAD": "/t.so:/i.so", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}}},
             "rows": rows, "offline": {"batch": 8, "prompt": 1024, "prefill_s": [4.0, 3.0], "prompt_tok_s": 2730.0},
             "prefill": {"ours": {"served": {"prompt_tokens": 16384, "prompt_tok_s": 1365.0},
                                  "metrics": {"prompt_tok_s": 2000.0}},
                         "vllm": {"served": {"prompt_tokens": 16384, "prompt_tok_s": 1800.0},
                                  "metrics": {"prompt_tokens": 16384, "request_prefill_s": 30.0,
                                              "per_request_prompt_tok_s": 546.0}}}}
    state["goodput"] = report.goodput(rows, a.ttft_bound_s)
    text = "\n".join(versus.markdown(state, a))
    for columns in (report.COLUMNS, report.GOODPUT_COLUMNS, report.PREFILL_COLUMNS):
        assert "| " + " | ".join(columns) + " |" in text
    assert "vllm 0.32.0, torch 2.13.0+cpu" in text and "aiperf 0.13.0" in text
    assert "`LD_PRELOAD=/t.so:/i.so VLLM_CPU_OMP_THREADS_BIND=0-1 py -m vllm" in text
    assert "| ours | 16384 | 1365 | 2000 | 2730 | 0.50 | 0.73 |" in text
    assert "| vllm | 16384 | 1800 | - | 2730 | 0.66 | - |" in text

"""The serving benchmark end to end on the tiny model: a real server subprocess, real HTTP, static
batches in process; and bad arguments refused before any server starts."""

import json

import pytest

from plugins.bench import serving

ARGS = ["--dtype", "float32", "--rates", "2", "8", "--requests", "4", "--streams", "2", "--max-tokens", "4", "12",
        "--stream-tokens", "8", "--prompt-len", "16", "--kv-budget", "1MB"]


@pytest.fixture(scope="module")
def run(ckpt_factory, tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "out"
    assert serving.main([str(ckpt_factory("tiny")), *ARGS, "--out", str(out)]) == 0
    return out, json.loads((out / "serve.json").read_text())


def load_phases(result):
    ph = result["phases"]
    return {"concurrent": ph["concurrent"], "mixed": ph["mixed"],
            **{f"open {p['rate']:g}": p for p in ph["open_loop"]}}


def test_files_and_tables(run):
    out, result = run
    for name in ("serve.json", "serve.md", "latency_vs_load.png", "server.log"):
        assert (out / name).stat().st_size > 0, name
    md = (out / "serve.md").read_text()
    for heading in ("## Concurrent", "## Open loop", "## Mixed", "## Static batches", "## Server vs static"):
        assert heading in md
    assert md.count("| offered req/s |") == 1 and "| 8 | 4 | 0 |" in md  # one row per rate
    assert result["server"]["exit_code"] == 0  # stopped gracefully by SIGTERM
    assert result["machine"]["cpu"] and result["machine"]["torch_threads"] >= 1


def test_every_phase_counts_what_the_server_reported(run):
    _, result = run
    phases = load_phases(result)
    assert [p["rate"] for p in result["phases"]["open_loop"]] == [2.0, 8.0]
    for name, p in phases.items():
        recs = p["records"]
        assert len(recs) == p["requests"] == 4 and p["errors"] == 0, name
        assert p["tokens"] == sum(r["tokens"] for r in recs), name
        assert all(1 <= r["tokens"] <= r["max_tokens"] and r["prompt_tokens"] >= 1 for r in recs), name
        assert p["throughput_tok_s"] == pytest.approx(p["tokens"] / p["wall_s"])
        for key in ("ttft", "itl", "latency"):
            assert 0 <= p[f"{key}_p50_s"] <= p[f"{key}_p99_s"], (name, key)
        assert p["ttft_p50_s"] > 0, name
        assert all(r["ttft_s"] > 0 and r["latency_s"] >= r["ttft_s"] for r in recs), name
    assert all(r["max_tokens"] == 8 for r in phases["concurrent"]["records"])
    # the open loop and the mixed phase send the same requests (seeded max_tokens in 4..12)
    sets = [[(r["index"], r["max_tokens"]) for r in p["records"]] for n, p in phases.items() if n != "concurrent"]
    assert all(s == sets[0] for s in sets) and all(4 <= m <= 12 for _, m in sets[0])


def test_static_runs_the_same_requests(run):
    _, result = run
    static, mixed = result["phases"]["static"], result["phases"]["mixed"]
    wanted = [r["max_tokens"] for r in mixed["records"]]
    assert static["useful_tokens"] == sum(wanted)
    assert [b["size"] for b in static["batches"]] == [2, 2]
    assert [b["max_new_tokens"] for b in static["batches"]] == [max(wanted[:2]), max(wanted[2:])]
    assert static["generated_tokens"] >= static["useful_tokens"]
    assert static["decode"]["batch_size"] == 2 and static["decode"]["decode_tok_s"] > 0
    r = result["ratios"]
    assert r["mixed_server_over_static"] == pytest.approx(mixed["throughput_tok_s"] / static["useful_tok_s"])
    assert r["concurrent_server_over_static_decode"] > 0


@pytest.mark.parametrize("extra,message", [
    (["--rates", "0"], "--rates must be positive"),
    (["--rates", "1", "-2"], "--rates must be positive"),
    (["--max-tokens", "12", "4"], "larger than MAX"),
    (["--requests", "0"], "--requests must be >= 1"),
    (["--stream-tokens", "1"], "--stream-tokens must be >= 2"),
    (["--prompt-len", "250"], "exceeds the model's context"),
    (["--backend", "nope"], "unknown backend"),
    (["--kv-budget", "lots"], "not a byte size"),
    (["--url", "localhost:8000"], "--url must be"),
])
def test_bad_arguments_exit_before_any_server(ckpt_factory, monkeypatch, capsys, extra, message):
    monkeypatch.setattr(serving, "ServerProcess", lambda *a, **k: pytest.fail("a server was started"))
    with pytest.raises(SystemExit) as exc:
        serving.main([str(ckpt_factory("tiny")), "--dtype", "float32", *extra])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_missing_checkpoint_is_an_argument_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(serving, "ServerProcess", lambda *a, **k: pytest.fail("a server was started"))
    with pytest.raises(SystemExit) as exc:
        serving.main([str(tmp_path / "nowhere")])
    assert exc.value.code == 2 and "nowhere" in capsys.readouterr().err


def test_prefix_bench_reuses_the_shared_context_and_reports_both_runs(ckpt_factory, tmp_path):
    from plugins.bench import prefix

    out = tmp_path / "prefix"
    args = [str(ckpt_factory("tiny")), "--dtype", "float32", "--prefix-len", "64", "--tail-len", "8",
            "--requests", "3", "--editor-steps", "4", "--max-tokens", "4", "--kv-budget", "1MB", "--out", str(out)]
    assert prefix.main(args) == 0
    result = json.loads((out / "prefix.json").read_text())
    on, off = result["on"], result["off"]
    for run in (on, off):
        assert run["shared_prefix"]["errors"] == 0 and run["editor"]["errors"] == 0
        assert run["shared_prefix"]["tokens"] == 3 * 4 and run["editor"]["requests"] == 4
    assert off["metrics"]["mqa_prefix_cache_hits_total"] == 0
    # every question after the first reuses the 64-token context; every edit reuses the file so far
    assert on["metrics"]["mqa_prefix_cache_hits_total"] >= 3 + 3
    assert on["metrics"]["mqa_prefix_cache_reused_tokens_total"] >= 3 * 64 + 3 * 64
    assert "| shared_prefix | on |" in (out / "prefix.md").read_text()


def test_n_choices_bench_prefills_once_and_samples_as_separate_requests(ckpt_factory, tmp_path):
    from plugins.bench import choices

    out = tmp_path / "choices"
    assert choices.main([str(ckpt_factory("tiny")), "--backend", "hf", "--dtype", "float32", "--n", "4",
                         "--prompt-len", "32", "--max-tokens", "6", "--passk-prompts", "2", "--passk-n", "2",
                         "--kv-budget", "64MB", "--out", str(out)]) == 0
    result = json.loads((out / "choices.json").read_text())
    assert result["n"]["prefill_tokens"] == 32 and result["n"]["choices"] == 4  # one prefill for 4 rows
    assert result["n"]["generation_tokens"] == result["separate"]["generation_tokens"] == 4 * 6
    assert result["same_samples"]  # choice j of n is request j alone (seed + j), fp32
    assert result["passk"]["choices"] == 4 and result["passk"]["prefill_tokens"] == 2 * 32


def test_chunked_prefill_bench_keeps_every_step_within_its_budget(ckpt_factory, tmp_path):
    from plugins.bench import chunked

    out = tmp_path / "chunked"
    assert chunked.main([str(ckpt_factory("tiny")), "--dtype", "float32", "--budgets", "0", "16", "--streams", "2",
                         "--stream-prompt", "16", "--stream-tokens", "12", "--long", "2", "--long-prompt", "64",
                         "--long-gap", "0.2", "--kv-budget", "64MB", "--out", str(out)]) == 0
    off, chunked16 = json.loads((out / "chunked.json").read_text())["results"]
    assert off["errors"] == chunked16["errors"] == []
    # whole prompts: one step per long prompt; budget 16: a 64-token prompt takes >= 4 steps
    assert chunked16["mixed_steps"] + chunked16["prefill_steps"] >= 2 * 64 / 16
    assert off["itl_p50_s"] > 0 and chunked16["long_ttft_p50_s"] > 0
    assert 0 < chunked16["stream_ttft_p50_s"] <= chunked16["stream_ttft_max_s"]


def test_speculation_bench_reports_acceptance_only_where_it_speculates(ckpt_factory, tmp_path):
    from plugins.bench import speculation

    out = tmp_path / "spec"
    assert speculation.main([str(ckpt_factory("tiny")), "--dtype", "float32", "--sets", "plain", "lookup",
                             "--streams", "1", "--prompt-len", "32", "--max-tokens", "12", "--rows", "1", "2",
                             "--kv-budget", "64MB", "--out", str(out)]) == 0
    result = json.loads((out / "speculation.json").read_text())
    assert result["served"]["plain"]["1"]["drafted"] == 0 and result["served"]["lookup"]["1"]["drafted"] > 0
    assert set(result["verify_cost"]) == {"1", "2"} and all(c["verify_s"] > 0 for c in result["verify_cost"].values())

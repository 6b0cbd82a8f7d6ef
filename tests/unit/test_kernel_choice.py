"""The CPU linear ladder's choice (plugins.kernels): the probe's decisions per rung, the forced-rung
switch, row buckets, and the measured table (timed once per machine, cached, the fastest chosen).
Marked `kernels`: make test reruns them with every lower rung forced."""

import json

import pytest
import torch
from kernel_timing import small_timing, static_row
from torch import nn

from plugins import kernels
from plugins.kernels import KERNEL_ROWS, PackedWeights, Probe
from plugins.kernels.quant import int8_linear, quantize_per_channel

pytestmark = pytest.mark.kernels


# --- the probe ------------------------------------------------------------------------------------

def test_ladder_decisions_per_rung():
    """Which implementation each rung gives bf16 and int8 linears, by number of rows."""
    avx512 = Probe("avx512", True, modules={"avx512": object()})  # with oneDNN's bf16 GEMM from 33 rows
    assert [avx512.bf16(r) for r in (1, 2, 16, 32, 33, 512)] == ["avx512"] * 4 + ["onednn"] * 2
    alone = Probe("avx512", False, modules={"avx512": object()})
    assert [alone.bf16(r) for r in (1, 512)] == ["avx512"] * 2
    assert [avx512.int8(r) for r in (1, 2, 16, 512)] == ["avx512"] * 4
    onednn = Probe("onednn", True, modules={"avx2": object()})
    assert [onednn.bf16(r) for r in (1, 16, 512)] == ["onednn"] * 3
    assert [onednn.int8(r) for r in (1, 2)] == ["avx2", "torch"]
    avx512f = Probe("avx512f", False, modules={"avx512f": object(), "avx2": object()})
    assert [avx512f.bf16(r) for r in (1, 2, 16, 512)] == ["avx512f"] * 4
    assert [avx512f.int8(r) for r in (1, 2, 16, 512)] == ["avx512f"] * 4 and avx512f.int4() == "torch"
    avx2 = Probe("avx2", False, modules={"avx2": object()})
    assert [avx2.bf16(r) for r in (1, KERNEL_ROWS, KERNEL_ROWS + 1)] == ["avx2", "avx2", "fp32"]
    assert [avx2.int8(r) for r in (1, 2)] == ["avx2", "torch"]
    plain = Probe("torch", False)
    assert [plain.bf16(r) for r in (1, 2)] == ["torch", "fp32"]
    assert plain.int8(1) == "torch"


def test_forced_rung_caps_the_probe(monkeypatch):
    native = kernels.probe()
    try:
        for rung in kernels.RUNGS[kernels.RUNGS.index(native.rung):]:
            monkeypatch.setenv(kernels.ENV, rung)
            kernels.reset()
            p = kernels.probe()
            assert p.forced == rung and kernels.RUNGS.index(p.rung) >= kernels.RUNGS.index(rung)
            if rung in ("avx512f", "avx2", "torch"):
                assert not p.bf16_gemm  # as on an AVX2-only CPU: no oneDNN bf16
            if rung == "torch":
                assert p.modules == {}
        monkeypatch.setenv(kernels.ENV, "avx9000")
        kernels.reset()
        with pytest.raises(ValueError,
                           match="PLUGINS_KERNELS='avx9000': expected one of avx512, onednn, avx512f, avx2, torch"):
            kernels.probe()
    finally:
        monkeypatch.undo()
        kernels.reset()
    assert kernels.probe() == native


def test_cpus_without_bf16_instructions_skip_onednn(monkeypatch):
    """oneDNN's emulated bf16 GEMM is slower than our kernels: without AVX512-BF16 / AMX-BF16 /
    AVX-NE-CONVERT the probe never picks it (the caps as this CPU reports them, bf16 flags cleared);
    an AVX512 CPU runs the avx512f rung instead."""
    caps = {k: v and k not in kernels.BF16_INSTRUCTIONS for k, v in kernels.capabilities().items()}
    monkeypatch.setattr(kernels, "capabilities", lambda: caps)
    monkeypatch.delenv(kernels.ENV, raising=False)
    monkeypatch.setenv(kernels.TABLE_ENV, "static")  # the flag ladder (the measured one times oneDNN too)
    try:
        kernels.reset()
        p = kernels.probe()
        assert not p.bf16_gemm and p.rung != "onednn" and "onednn" not in p.describe()["bf16"].values()
        assert not kernels.has_bf16_instructions(caps)
        if kernels.supported("avx512f", caps) and "avx512f" in p.modules:  # (it built)
            assert p.rung == "avx512f" and set(p.describe()["bf16"].values()) == {"avx512f"}
    finally:
        monkeypatch.undo()
        kernels.reset()


# --- the measured table ----------------------------------------------------------------------------

LABELS = [kernels.bucket_label(i) for i in range(len(kernels.BUCKETS) + 1)]


def test_buckets_cover_every_row_count():
    assert LABELS == ["1", "2-8", "9-32", "33-128", "129-512", ">512"]
    rows = (1, 2, 8, 9, 32, 33, 128, 129, 512, 513, 4096)
    assert [kernels.bucket(r) for r in rows] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert [kernels.bucket(r) for r in kernels.TIMED_ROWS] == list(range(len(LABELS)))


def test_choice_is_the_fastest_and_one_row_is_row_invariant():
    from plugins.kernels.measure import choose

    wanted = {"bf16": ["avx2", "onednn", "fp32"], "int8": ["avx2", "torch", "dequant"], "int4": ["torch"]}
    bf16 = [{"avx2": 5, "onednn": 4, "fp32": 9}, {"avx2": 8, "onednn": 6, "fp32": 9},
            {"avx2": 20, "onednn": 30, "fp32": 9}, {"avx2": 80, "onednn": 30, "fp32": 50},
            {"avx2": 300, "onednn": 90, "fp32": 200}, {"avx2": None, "onednn": 700, "fp32": 600}]  # None: not timed
    int8 = [{"avx2": 3, "torch": 1, "dequant": 90}] + [{"avx2": 9, "torch": 8, "dequant": 7}] * 5
    timings = {"bf16": dict(zip(LABELS, bf16)), "int8": dict(zip(LABELS, int8)),
               "int4": {label: {"torch": 1} for label in LABELS},
               "extra": "ignored"}
    got = choose(timings, wanted)
    # one row: oneDNN is faster (4 < 5) but not row-invariant, so the avx2 kernel; then the fastest
    assert got["bf16"] == ("avx2", "onednn", "fp32", "onednn", "onednn", "fp32")
    assert got["int8"] == ("avx2",) + ("dequant",) * 5
    assert got["int4"] == ("torch",) * 6
    probe = Probe("avx2", False, modules={"avx2": object()}, choices=got)
    assert [probe.bf16(r) for r in (1, 3, 20, 100, 300, 2048)] == list(got["bf16"])
    assert [probe.int8(r) for r in (1, 2, 2048)] == ["avx2", "dequant", "dequant"] and probe.int4() == "torch"
    assert probe.describe()["table"] == "measured" and probe.describe()["bf16"]["33-128"] == "onednn"
    with kernels.rows_alone():  # a verify of several rows computes each as the one-row choice
        assert kernels.choice_rows(40) == 1


def test_timings_are_cached_and_timed_again_only_when_they_do_not_cover(tmp_path, monkeypatch):
    from plugins.kernels import measure

    p = kernels.probe()
    wanted = {kind: p.candidates(kind) for kind in kernels.KINDS}
    calls = []

    def fake(wanted_now, layer=measure.LAYER, watch=None):  # our own timing loop, counted (real runs: next test)
        calls.append(wanted_now)
        return {kind: {label: {c: 1.0 + i for i, c in enumerate(wanted_now[kind])} for label in LABELS}
                for kind in wanted_now}

    monkeypatch.setattr(measure, "time_candidates", fake)
    path = tmp_path / "choices.json"
    choices, timings = measure.measured_choices(p, path)
    assert len(calls) == 1 and path.is_file() and not list(tmp_path.glob(".*.tmp"))
    assert timings["bf16"]["1"] == {c: 1.0 + i for i, c in enumerate(wanted["bf16"])}
    assert measure.measured_choices(p, path)[0] == choices and len(calls) == 1  # read back, not timed
    data = json.loads(path.read_text())
    del data["int8"]["9-32"][wanted["int8"][0]]  # a candidate the file does not hold: that kind timed again
    path.write_text(json.dumps(data))
    measure.measured_choices(p, path)
    assert len(calls) == 2 and list(calls[1]) == ["int8"]
    for bad in ("not json", json.dumps({"bf16": {"1": {"avx2": -1}}}), json.dumps([1, 2]),
                json.dumps({k: {"1": {"torch": None}} for k in kernels.KINDS})):
        path.write_text(bad)  # a damaged file is timed again, never trusted
        measure.measured_choices(p, path)
    assert len(calls) == 6
    assert measure.machine_key() == measure.machine_key() and len(measure.machine_key()) == 20


def test_every_candidate_runs_and_the_timing_loop_reports_each():
    """Each candidate this process offers computes the same linear (within bf16 / int8 error), and the
    real timing loop (on a small layer) gives every candidate a positive time in every bucket."""
    from plugins.kernels import measure
    from plugins.kernels.quant import int4_linear, quantize_int4

    p = kernels.probe()
    w, b = torch.randn(72, 96).bfloat16(), torch.randn(72).bfloat16()
    x = torch.randn(5, 96).bfloat16()
    ref = nn.functional.linear(x.float(), w.float(), b.float())
    for impl in p.candidates("bf16"):
        out = kernels.linear(x, w, b, packs=PackedWeights(), impl=impl)
        assert (out.float() - ref).abs().max() <= ref.abs().max() * 2 ** -7 + 1e-2, impl
    q, scales = quantize_per_channel(w)
    qref = nn.functional.linear(x.float(), q.float() * scales[:, None], b.float())
    for impl in p.candidates("int8"):
        out = int8_linear(x, q, scales.bfloat16(), b, packs=PackedWeights(), impl=impl)
        assert (out.float() - qref).abs().max() <= qref.abs().max() * 2 ** -6 + 2e-2, impl
    outs = [int4_linear(x, quantize_int4(w.float(), layout=impl), b) for impl in p.candidates("int4")]
    assert all((o.float() - outs[0].float()).abs().max() < 0.1 * ref.abs().max() for o in outs)
    wanted = {kind: p.candidates(kind) for kind in kernels.KINDS}
    timed = measure.time_candidates(wanted, layer=[(70, 130), (64, 256)])
    for kind in kernels.KINDS:
        assert list(timed[kind]) == LABELS
        for label in LABELS:  # every candidate has its entry; a dropped one (None) lost by 4x before
            times = timed[kind][label]
            assert set(times) == set(wanted[kind])
            assert all(v is None or v > 0 for v in times.values()) and any(v is not None for v in times.values())


# --- a busy machine's timings are not kept -------------------------------------------------------

def test_the_busy_detector_reads_the_cores_other_processes_took():
    """What other processes' CPU time during a window means for a timing: the share of the cores its
    threads run on that others took (beyond the cores those threads leave free)."""
    from plugins.kernels.measure import BUSY_SHARE, contention

    assert contention(0.0, 1.0, cpus=2, threads=2) == 0.0  # nothing else ran
    assert contention(0.02, 1.0, cpus=2, threads=2) < BUSY_SHARE  # kernel threads, a shell
    # one busy loop beside a 2-thread timing on 2 cores: 3 runnable threads, the loop gets ~2/3 of a core
    assert contention(2 / 3, 1.0, cpus=2, threads=2) == pytest.approx(1 / 3) and 1 / 3 > BUSY_SHARE
    assert contention(4.0, 4.0, cpus=2, threads=2) == 0.5  # two loops: half of each core
    # a 1-thread timing (a tensor-parallel rank) shares nothing with one process on the other core...
    assert contention(1.0, 1.0, cpus=2, threads=1) == 0.0
    # ...but two loops and the timing's thread on 2 cores take a third of its core
    assert contention(4 / 3, 1.0, cpus=2, threads=1) == pytest.approx(1 / 3)
    assert contention(1.0, 1.0, cpus=1, threads=4) == 1.0  # more threads than cores: the cores count


def fake_sample(others_cores: float):
    """cpu_sample as if other processes used `others_cores` cores the whole time (0: quiet by
    construction, whatever the machine does) beside this process's real CPU time."""
    import resource
    import time

    start = time.perf_counter()

    def sample():
        now, usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        own = usage.ru_utime + usage.ru_stime
        return now, own + others_cores * (now - start), own
    return sample


def test_load_watch_reads_whole_windows():
    import os

    from plugins.kernels import measure

    cpus, threads, window = len(os.sched_getaffinity(0)), torch.get_num_threads(), measure.WINDOW_S
    clock = [0.0, 0.0]  # wall s, CPU s of other processes (this process: none)
    watch = measure.LoadWatch(sample=lambda: (clock[0], clock[1], 0.0))
    clock[0] = window / 2
    assert watch.read() is None and watch.readings == []  # too short to read (ticks)
    clock[0] = window
    assert watch.read() == 0.0 and watch.readings == [0.0]
    clock[:] = [window * 1.1, window * 0.1 * cpus]  # a last window, others on every core:
    assert watch.read(final=True) is None  # a tenth of a window changes nothing
    clock[:] = [window * 1.3, window * 0.3 * cpus]  # three tenths are read
    assert watch.read() is None and watch.read(final=True) == pytest.approx(measure.contention(
        window * 0.3 * cpus, window * 0.3, cpus, threads))
    watch.restart()
    clock[:] = [10.0, clock[1] + (10.0 - clock[0]) * cpus]  # others on every core all the time since
    assert watch.read() == 1.0 > measure.BUSY_SHARE
    assert watch.note.startswith("other processes took 100% of the cores the timing ran on")
    assert measure.LoadWatch(sample=lambda: None).read(final=True) is None  # no /proc/stat: nothing read


def test_a_quiet_table_is_kept_and_a_busy_reading_is_not(tmp_path, monkeypatch):
    """The same timing read through samples that are busy (other processes on every core all along)
    or quiet (none ever ran) by construction, whatever this machine does meanwhile: busy is not kept,
    a process starting within BUSY_HOLD_S takes the fixed choices without timing, a later one times
    again; quiet is kept, and read back by the next process."""
    import os

    from plugins.kernels import measure

    p = kernels.decision()
    small_timing(monkeypatch, window_s=0.02)
    path = tmp_path / "choices.json"
    monkeypatch.setattr(measure, "cpu_sample", fake_sample(len(os.sched_getaffinity(0))))  # every core
    choices, timings = measure.measured_choices(p, path, kinds=("bf16",))
    assert not path.exists() and isinstance(timings["bf16"], str) and choices["bf16"] == static_row(p, "bf16")
    monkeypatch.setattr(measure, "cpu_sample", fake_sample(0.0))
    real = measure.time_candidates
    monkeypatch.setattr(measure, "time_candidates", None)  # within BUSY_HOLD_S: not timed
    held = measure.measured_choices(p, path, kinds=("bf16",))
    assert held[0] == choices and held[1]["bf16"].startswith(timings["bf16"]) and held[1]["bf16"].endswith(" s ago")
    monkeypatch.setattr(measure, "time_candidates", real)
    monkeypatch.setattr(measure, "BUSY_HOLD_S", 0.0)  # a later start
    choices, timings = measure.measured_choices(p, path, kinds=("bf16",))
    kept = json.loads(path.read_text())
    assert {k for k, v in kept.items() if v} == {"bf16"} and timings["bf16"] == kept["bf16"]
    assert choices == measure.choose(kept, {"bf16": p.candidates("bf16")})
    monkeypatch.setattr(measure, "time_candidates", None)  # read back: not timed again
    assert measure.measured_choices(p, path, kinds=("bf16",)) == (choices, timings)


def test_a_busy_moment_is_timed_again_and_kept(tmp_path, monkeypatch):
    """One busy window (the first read, quiet samples otherwise): its races run again, the table is
    kept."""
    from plugins.kernels import measure

    class OneBusyWindow(measure.LoadWatch):
        def read(self, final=False):
            share = super().read(final)
            if share is not None and len(self.readings) == 1:
                self.readings[-1] = share = 1.0
            return share

    p = kernels.decision()
    watches = small_timing(monkeypatch, window_s=0.02)
    monkeypatch.setattr(measure, "cpu_sample", fake_sample(0.0))
    monkeypatch.setattr(measure, "LoadWatch", OneBusyWindow)
    path = tmp_path / "choices.json"
    choices, timings = measure.measured_choices(p, path, kinds=("bf16",))
    assert watches[0].readings[0] == 1.0 and set(watches[0].readings[1:]) == {0.0}
    assert json.loads(path.read_text())["bf16"] == timings["bf16"] and list(timings["bf16"]) == LABELS


def test_remeasure_drops_the_cached_table_and_times_again(tmp_path, monkeypatch, capsys):
    """`python -m plugins.kernels --remeasure [--kind K]`: the cached table of this machine (of K only)
    is dropped and timed again; the other kinds' stay."""
    import runpy
    import sys

    from plugins.kernels import measure

    monkeypatch.setenv(kernels.TABLE_ENV, "measured")
    monkeypatch.setattr(measure, "cache_dir", lambda: tmp_path)
    kernels.reset()
    p = kernels.decision()  # what the command's probe offers
    planted = {kind: {label: {c: 999.0 for c in p.candidates(kind)} for label in LABELS} for kind in kernels.KINDS}
    measure.table_path().write_text(json.dumps(planted))
    calls = []

    def fake(wanted, layer=None, watch=None):
        calls.append(sorted(wanted))
        return {kind: {label: {c: 1.0 + i for i, c in enumerate(wanted[kind])} for label in LABELS} for kind in wanted}
    monkeypatch.setattr(measure, "time_candidates", fake)
    try:
        for argv, timed in ((["--kind", "int4"], []), (["--kind", "int4", "--remeasure"], [["int4"]]),
                            (["--remeasure"], [["int4"], ["bf16", "int4", "int8"]])):
            kernels.reset()
            monkeypatch.setattr(sys, "argv", ["plugins.kernels", *argv])
            runpy.run_module("plugins.kernels", run_name="__main__")
            assert calls == timed
            table = json.loads(measure.table_path().read_text())
            out = json.loads(capsys.readouterr().out)
            assert out["table"] == "measured"
            assert (table["bf16"] == planted["bf16"]) == (len(timed) < 2)
            assert (table["int4"] == planted["int4"]) == (not timed)
        measure.table_path().with_suffix(".busy").write_text(json.dumps({"at": __import__("time").time(), "note": "x"}))
        measure.forget()  # --remeasure times now, even right after a timing stopped for load
        assert not measure.table_path().exists() and not measure.table_path().with_suffix(".busy").exists()
    finally:
        kernels.reset()


def test_table_mode_switch(monkeypatch):
    native = kernels.probe()
    try:
        monkeypatch.setenv(kernels.TABLE_ENV, "static")
        kernels.reset()
        p = kernels.probe()
        assert p.choices is None and p.describe()["table"] == "static" and "timings_ms" not in p.describe()
        assert [p.bf16(r) for r in (1, 64)] == [p.static("bf16", 1), p.static("bf16", 64)]
        monkeypatch.setenv(kernels.TABLE_ENV, "fastest")
        kernels.reset()
        with pytest.raises(ValueError, match="PLUGINS_KERNELS_TABLE='fastest': expected 'measured' or 'static'"):
            kernels.probe()
    finally:
        monkeypatch.undo()
        kernels.reset()
    assert kernels.probe() == native
    if kernels.table_mode() == "measured":
        assert native.choices is not None and set(native.timings) == set(kernels.KINDS)
        for kind in ("bf16", "int8"):  # the choice is the fastest timed, one row among row-invariant ones
            if isinstance(native.timings[kind], str):  # timed on a busy machine: the fixed choices, not kept
                assert native.choices[kind] == static_row(native, kind)
                continue
            for i, label in enumerate(LABELS):
                times = {c: t for c, t in native.timings[kind][label].items() if t is not None}
                assert native.choices[kind][i] in times
                if i > 0:
                    assert times[native.choices[kind][i]] == min(times.values())


def test_fp32_runs_time_nothing_and_the_first_bf16_linear_measures(monkeypatch, ckpt):
    """The kernels are built when DeepSpeed's layers are injected; the implementations are timed only
    when a linear first asks which to run (an fp32 run never does), and only for its kind: a bf16 run
    times no int8 or int4 candidate."""
    from plugins.engine.registry import load_backend

    monkeypatch.setenv(kernels.TABLE_ENV, "measured")
    kernels.reset()
    try:
        backend = load_backend("deepspeed", ckpt, dtype="float32")
        ids = torch.tensor([[5, 6, 7, 8]])
        backend.generate(ids, torch.ones_like(ids), 3)
        assert kernels._DECISION is not None and kernels._PROBE is None
        assert kernels.decision().describe() == {"rung": kernels.decision().rung, "forced": kernels.forced_rung(),
                                                 "bf16_gemm": kernels.decision().bf16_gemm,
                                                 "table": "not measured (no bf16, int8 or int4 linear ran)"}
        kernels.linear(torch.randn(2, 64).bfloat16(), torch.randn(32, 64).bfloat16())
        assert kernels._PROBE is not None and set(kernels._PROBE.choices) == set(kernels._PROBE.timings) == {"bf16"}
        described, busy = kernels._PROBE.describe(), isinstance(kernels._PROBE.timings["bf16"], str)
        if busy:  # timed while something else ran here: the fixed choices, not kept
            assert described["table"].startswith("static for bf16") and kernels._PROBE.choices["bf16"] == static_row(
                kernels._PROBE, "bf16")
        else:
            assert described["table"] == "measured"
            assert set(described["bf16"].values()) <= set(kernels.decision().candidates("bf16"))
        assert described["int8"] == described["int4"] == "not measured (no linear of this kind ran)"
        q, scales = quantize_per_channel(torch.randn(32, 64).bfloat16())
        int8_linear(torch.randn(2, 64).bfloat16(), q, scales.bfloat16(), None)  # now int8 is timed too, not int4
        assert set(kernels._PROBE.choices) == set(kernels._PROBE.timings) == {"bf16", "int8"}
        assert kernels._PROBE.describe()["int8"]["1"] in {*kernels.decision().candidates("int8"),
                                                          kernels._PROBE.static("int8", 1)}
    finally:
        monkeypatch.undo()
        kernels.reset()

"""A kernel table timed while other processes take the cores is not kept (busy loops started here: a
process start, so not in tests/unit)."""

from kernel_timing import replace_choices, small_timing, static_row

from plugins import kernels


def test_a_table_timed_beside_busy_loops_is_not_kept(tmp_path, monkeypatch, capsys):
    """Busy loops (twice as many as this process may use CPUs, so they take at least half of every
    core whatever the timing's thread count) run while the table is timed: the watch reads them in
    every window, so past the retries the process gets the ladder's fixed choices, the file is not
    written, one line says so. More load from anything else only reads busier."""
    import os
    import subprocess
    import sys
    import time

    from plugins.kernels import measure

    p = kernels.decision()
    watches = small_timing(monkeypatch)
    path = tmp_path / "choices.json"
    loops = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(2 * len(os.sched_getaffinity(0)))]
    try:
        time.sleep(0.2)  # running
        choices, timings = measure.measured_choices(p, path, kinds=("bf16",))
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    assert not path.exists()
    assert choices == {"bf16": static_row(p, "bf16")}
    assert timings["bf16"].startswith("not kept: other processes took")
    assert len([r for r in watches[0].readings if r > measure.BUSY_SHARE]) == measure.RETRIES + 1
    err = capsys.readouterr().err.splitlines()
    assert len([line for line in err if "and the timings are not kept (timed again by a start" in line]) == 1
    probe = replace_choices(p, choices, timings)
    assert probe.describe()["table"] == "static for bf16: the machine was busy while timing"
    assert [probe.bf16(r) for r in (1, 64, 4096)] == [p.static("bf16", r) for r in (1, 64, 4096)]

"""Kernel-table timing helpers the unit and integration tests share: a small layer to time, the static
row of a probe, a probe with other choices."""

from plugins import kernels
from plugins.kernels import Probe


def static_row(p: Probe, kind: str) -> tuple:
    return tuple(p.static(kind, r) for r in (1, *kernels.BUCKETS[1:], kernels.BUCKETS[-1] + 1))


SMALL_LAYER = [(512, 1024), (1024, 512)]  # ~0.5 s of bf16 races on 2 quiet cores: a window or so


def small_timing(monkeypatch, window_s: float | None = None):
    """measure.time_candidates on SMALL_LAYER, the watch measured_choices gives it kept; short pauses.
    `window_s` shortens the load windows, for samples faked exactly (a rung with few candidates times
    SMALL_LAYER in under WINDOW_S on a fast CPU; /proc/stat's 10 ms ticks want the real one)."""
    from plugins.kernels import measure

    monkeypatch.setattr(measure, "RETRY_PAUSE_S", 0.1)
    if window_s is not None:
        monkeypatch.setattr(measure, "WINDOW_S", window_s)
    real, watches = measure.time_candidates, []

    def timing(wanted, layer=None, watch=None):
        watches.append(watch)
        return real(wanted, layer=SMALL_LAYER, watch=watch)
    monkeypatch.setattr(measure, "time_candidates", timing)
    return watches


def replace_choices(p: Probe, choices: dict, timings: dict) -> Probe:
    from dataclasses import replace

    return replace(p, choices=choices, timings=timings)

"""Clocks that mark the phases of a training step: the host's wall clock, or timing events on an accelerator's
current stream, read once the device has passed them (the host runs ahead of the device: docs/scaling-report.md)."""

from __future__ import annotations

import time

import torch


class HostClock:
    """The host's wall clock (``time.perf_counter``): every mark is ready at once."""

    name = "host"

    def mark(self) -> float:
        return time.perf_counter()

    def ready(self, mark: float) -> bool:
        return True

    def wait(self, mark: float) -> None:
        pass

    def seconds(self, start: float, end: float) -> float:
        return end - start


class DeviceEventClock:
    """Timing events (``torch.Event``) recorded on the current stream of ``device``: a mark is ready when the
    device has executed the work queued before it; :meth:`seconds` is the device time between two marks."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.name = f"{self.device.type} events"

    def mark(self) -> torch.Event:
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    def ready(self, mark: torch.Event) -> bool:
        return mark.query()

    def wait(self, mark: torch.Event) -> None:
        mark.synchronize()

    def seconds(self, start: torch.Event, end: torch.Event) -> float:
        return start.elapsed_time(end) / 1000


StepClock = HostClock | DeviceEventClock
"""Marks points in time (``mark``), says when one has happened (``ready``, ``wait``), measures ``seconds`` between."""


def supports_device_events(device: torch.device) -> bool:
    """Whether ``device`` has timing events (CUDA, ROCm, XPU and other accelerators; not the CPU): two are
    recorded and timed once here, since some backends create an event but fail when it is recorded."""
    if device.type == "cpu" or not hasattr(torch, "Event"):  # torch.Event: torch >= 2.4
        return False
    try:
        start, end = (torch.Event(device=device, enable_timing=True) for _ in range(2))
        start.record()
        end.record()
        end.synchronize()
        start.elapsed_time(end)
    except Exception:  # not built with this device's runtime, no device present, no timing events: all the same here
        return False
    return True


def step_clock(device: torch.device, device_timing: bool | None = None) -> StepClock:
    """The clock for a training step on ``device``: device events where the device has them and ``device_timing`` is not
    False, the host clock otherwise; ``device_timing=True`` on a device without events is an error."""
    supported = supports_device_events(device)
    if device_timing and not supported:
        raise ValueError(
            f"`device_timing`=True is not valid on device {str(device)!r}: it has no timing events (torch.Event); "
            "expected None (use them where available) or False (host wall clock)."
        )
    return DeviceEventClock(device) if supported and device_timing is not False else HostClock()

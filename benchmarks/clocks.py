"""The SM clock while timed work runs: NVML's current SM clock, read every half millisecond while the host
waits for the timed runs to finish, on the GPU the work runs on.

The H200 does not hold its clock through a long burst of tensor work: the same kernel timed for 50 ms and
for 300 ms reads 9-15% apart (docs/results.md#sweep), so a rate is read beside the clock it ran at. NVML
is the driver's own library (libnvidia-ml.so.1, which nvidia-smi uses), called through ctypes; where it
cannot be loaded the timings carry no clock rather than a made-up one.

    ...queue the timed runs...
    wait_reading_clock(last_event)  -> {"median_mhz": 1755, "min_mhz": 1590, "max_mhz": 1980, "samples": 412} or None
"""

from __future__ import annotations

import ctypes
import time

import numpy as np

from . import device

NVML_CLOCK_SM = 1
NVML_SUCCESS = 0
PERIOD_S = 0.0005


class _Nvml:
    """libnvidia-ml.so.1, initialised once; handle(bus_id) the device with that PCI bus id."""

    def __init__(self):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2() != NVML_SUCCESS:
            raise OSError("nvmlInit_v2 failed")
        self.handles = {}

    def handle(self, bus_id: str):
        if bus_id not in self.handles:
            h = ctypes.c_void_p()
            if self.lib.nvmlDeviceGetHandleByPciBusId_v2(bus_id.encode(), ctypes.byref(h)) != NVML_SUCCESS:
                raise OSError(f"NVML has no device at PCI bus id {bus_id}")
            self.handles[bus_id] = h
        return self.handles[bus_id]

    def sm_clock(self, handle) -> int | None:
        mhz = ctypes.c_uint()
        ok = self.lib.nvmlDeviceGetClockInfo(handle, NVML_CLOCK_SM, ctypes.byref(mhz)) == NVML_SUCCESS
        return int(mhz.value) if ok else None


_nvml: _Nvml | None | bool = False  # False: not tried yet; None: unavailable


def nvml() -> _Nvml | None:
    global _nvml
    if _nvml is False:
        try:
            _nvml = _Nvml()
        except (OSError, AttributeError):
            _nvml = None
    return _nvml


def current_device_handle():
    """NVML's handle of the CUDA device CuPy works on (by PCI bus id: NVML numbers devices its own way), or
    None where NVML or the bus id is not to be had."""
    lib = nvml()
    if lib is None:
        return None
    try:
        return lib.handle(device.get_cupy().cuda.Device().pci_bus_id)
    except (OSError, AttributeError, RuntimeError):
        return None


def wait_reading_clock(event, read=None) -> dict | None:
    """Wait for `event` (the timed runs' last), reading the SM clock every PERIOD_S meanwhile: the median,
    min and max MHz of the reads, or None where NVML is unavailable. The host queues the runs faster than
    the GPU runs them, so the reads cover most of the runs, not the first few queued before the wait."""
    if read is None:
        handle = current_device_handle()
        read = (lambda: nvml().sm_clock(handle)) if handle is not None else None
    samples = []
    while not event.done:
        if read is not None and (mhz := read()):
            samples.append(mhz)
        time.sleep(PERIOD_S)
    event.synchronize()
    if not samples:
        return None
    s = np.array(samples)
    return {"median_mhz": float(np.median(s)), "min_mhz": int(s.min()), "max_mhz": int(s.max()), "samples": int(s.size)}

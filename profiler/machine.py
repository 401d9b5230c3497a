"""What machine a measurement ran on, for the records benchmarks and sweeps write beside their
numbers: CPU model, cores, memory, Python, torch and its threads, and the load average."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Sequence


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none): above ~0.5 per core,
    other processes shared the CPU with the measurement."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def meminfo_bytes(field: str) -> int | None:
    """A field of the kernel's /proc/meminfo in bytes (MemTotal, MemAvailable, ...); None where
    there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine_info(libraries: Sequence[str] = ()) -> dict:
    """CPU model, cores, torch version and threads, Python, platform, memory in GiB, and the
    version of each of ``libraries`` (None when it is not installed)."""
    import torch

    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "platform": platform.platform()}
    total = meminfo_bytes("MemTotal")
    if total is not None:
        info["memory_gib"] = round(total / 1024**3, 1)
    for name in libraries:
        try:
            info[name] = __import__(name).__version__
        except Exception:  # not installed, or broken on import: the record says so and the run goes on
            info[name] = None
    return info


def describe(info: dict) -> str:
    """One sentence for a report: "Machine: cpu ..., cores 2, ..." (unknown values left out)."""
    return "Machine: " + ", ".join(f"{k} {v}" for k, v in info.items() if v is not None) + "."


__all__ = ["cpu_name", "load_average", "machine_info", "meminfo_bytes", "describe"]

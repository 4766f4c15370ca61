"""Resident-memory probes shared by the benchmark scripts (Linux /proc)."""

from __future__ import annotations

import os


def rss_bytes() -> int:
    """Current resident set size."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Reset VmHWM, the process's peak RSS, to its current RSS (Linux >= 4.0: write 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    """Peak resident set size since start or the last ``reset_peak_rss``."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")

"""How much host memory there is, and how much can be had now: what decides whether a copy of some weights fits
(a packed bf16 linear here, a model copy in another dtype for calibration)."""

import os

MEMINFO = "/proc/meminfo"


def free_host_memory(meminfo: str = MEMINFO) -> int:
    """Bytes of host memory that can be had now: Linux's MemAvailable, which counts the page cache the kernel
    gives back on demand. Unused pages alone (the fallback where there is no MemAvailable) shrink to little
    on a machine that has read a few GB of files, though that memory is there for the asking."""
    try:
        with open(meminfo, encoding="ascii") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def total_host_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

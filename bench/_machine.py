"""What machine a benchmark ran on, recorded beside its numbers.

The ratios between trioring and its peers depend on the machine as much as on the code: on
two 2-vCPU virtual machines of this project, one Intel Xeon and one AMD EPYC, the same code
took 1.2 and 2.2-3.5 times Open MPI's time for a 64 KiB broadcast at world 2 (``bench/paired.py``),
and two AMD EPYC machines chose opposite algorithms at 4 MiB (see
src/trioring/_collectives/_limits.py). So every results file says which machine it came
from, and the tables print it. It reads /proc/cpuinfo itself: trioring's
``_onehost._cpus.cpu_vendor`` gives the vendor alone, and this file, like ``_harness.py``,
imports nothing of trioring's, so that it describes the machine the same for every peer."""

from __future__ import annotations

import os
import platform


def _cpuinfo() -> dict[str, str]:
    """The first CPU's block of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def machine() -> dict[str, object]:
    """The CPU (model name, vendor, family and model numbers as the kernel gives them), how
    many CPUs the machine has and this process may use, the kernel and Python."""
    info = _cpuinfo()
    return {
        "cpu": info.get("model name", platform.processor() or "unknown"),
        "vendor": info.get("vendor_id", ""),
        "family": info.get("cpu family", ""),
        "model": info.get("model", ""),
        "cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "hypervisor": "hypervisor" in info.get("flags", "").split(),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def describe(facts: dict[str, object] | None) -> str:
    """One line for a table's heading, or "" for results written before machines were
    recorded."""
    if not facts:
        return ""
    where = "a virtual machine" if facts.get("hypervisor") else "a machine"
    cpu = f"{facts.get('cpu')} (family {facts.get('family')}, model {facts.get('model')})"
    return (
        f"{where} with {facts.get('usable_cpus')} of {facts.get('cpus')} CPUs usable, {cpu}, "
        f"Linux {facts.get('kernel')}, Python {facts.get('python')}"
    )


if __name__ == "__main__":
    print(describe(machine()))

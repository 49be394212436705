"""What machine this is, as far as a table's steps per second depend on it."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["CPU_MATCH", "host_cpu", "cpu_similarity"]

# What a CPU's steps per second depend on most, in the order they count when a packaged table is matched to
# this host: the same widest vector unit (a table of another one is never preferred: under a hypervisor the
# model name is often generic, "AMD EPYC" for an AVX2 and an AVX-512 generation alike), the same family and
# model numbers (the generation), the same model name, the same vendor, the same core count. Each weight
# exceeds the sum of those after it.
CPU_MATCH = (("isa", 16), ("family", 8), ("model_name", 4), ("vendor", 2), ("cores", 1))


def host_cpu() -> dict[str, Any]:
    """The CPU this process runs on, as far as its steps per second depend on it: ``vendor``, ``model_name``,
    ``family`` (x86 ``"cpu family/model"``, e.g. ``"25/17"`` for AMD Zen 4; ``""`` where unknown), ``isa``
    (the widest vector unit: ``amx``, ``avx512``, ``avx2``, ``sve``, ``neon`` or ``""``), ``cores`` and
    ``machine``. Read from ``/proc/cpuinfo`` on Linux, from :mod:`platform` elsewhere. The profiler records it
    in every table (``metadata.extra["cpu"]``) and :func:`default_sps_table` matches it. Under a hypervisor
    the model name can be generic ("Intel(R) Xeon(R) Processor", "AMD EPYC"); the instruction set and the
    family and model numbers still tell the generations apart."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    isa = next((name for name, flag in (("amx", "amx_tile"), ("avx512", "avx512f"), ("avx2", "avx2"),
                                        ("sve", "sve"), ("neon", "asimd")) if flag in flags), "")
    family = f"{fields['cpu family']}/{fields['model']}" if "cpu family" in fields and "model" in fields else ""
    return {"vendor": fields.get("vendor_id", ""), "model_name": fields.get("model name", platform.processor()),
            "family": family, "isa": isa, "cores": os.cpu_count() or 0, "machine": platform.machine()}


def cpu_similarity(a: dict[str, Any], b: dict[str, Any]) -> int:
    """How alike two :func:`host_cpu` records are (:data:`CPU_MATCH` weights of the fields that are known
    and equal in both; the machine must agree, else 0)."""
    if a.get("machine") != b.get("machine"):
        return 0
    return sum(w for key, w in CPU_MATCH if a.get(key) not in (None, "", 0) and a.get(key) == b.get(key))

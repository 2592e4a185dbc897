"""How many threads inference may use: the CPUs this process may run on — its CPU affinity and,
in a container, its cgroup CPU limit. torch and ONNX Runtime size their pools from the
machine's cores, which a pod limited to 2 CPUs on a 64-core node would oversubscribe: every
thread past the quota waits for the next scheduling period (CPU throttling)."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from limelight.settings import Settings

log = logging.getLogger(__name__)

#: Where the cgroup file systems are mounted (v2 unified, or v1 with a ``cpu`` controller).
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path | None = None) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (1.5 for ``150000 100000``), or None when
    there is none (``max``, ``-1``) or no cgroup file says."""
    root = CGROUP_ROOT if root is None else root
    try:
        fields = (root / "cpu.max").read_text().split()  # v2: "<quota|max> <period>"
        if len(fields) == 2 and fields[0] != "max":
            return int(fields[0]) / int(fields[1])
        if fields:
            return None
    except (OSError, ValueError):
        pass
    for v1 in (root / "cpu", root / "cpu,cpuacct", root):
        try:
            quota = int((v1 / "cpu.cfs_quota_us").read_text())
            period = int((v1 / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota / period if quota > 0 and period > 0 else None
    return None


def usable_cpus(root: Path | None = None) -> int:
    """CPUs this process may use: its affinity, capped by its cgroup quota (rounded up)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    return max(1, min(cores, math.ceil(limit)) if limit is not None else cores)


def inference_threads(settings: Settings, default: int, root: Path | None = None) -> int:
    """Intra-op threads for torch and ONNX Runtime: ``torch_threads`` when set; else the
    runtime's own ``default`` (its count of physical cores), lowered to this process's share of
    the usable CPUs (the cgroup limit; with ``workers`` sidecar processes, a share each)."""
    if settings.torch_threads > 0:
        return settings.torch_threads
    share = max(1, usable_cpus(root) // max(1, settings.workers))
    return max(1, min(default, share))

"""Inference threads follow the CPUs a process may use: a container's cgroup CPU limit (v1 and
v2), shared among sidecar workers; an explicit ``torch_threads`` wins."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from limelight import cpus
from limelight.cpus import cgroup_cpu_limit, inference_threads, usable_cpus
from limelight.settings import Settings


def cgroup(root: Path, **files: str) -> Path:
    for name, text in files.items():
        path = root / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


def test_the_cgroup_quota_in_cpus(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(cgroup(tmp_path / "a", **{"cpu.max": "150000 100000"})) == 1.5
    assert cgroup_cpu_limit(cgroup(tmp_path / "b", **{"cpu.max": "max 100000"})) is None
    v1 = {"cpu__cpu.cfs_quota_us": "200000", "cpu__cpu.cfs_period_us": "100000"}
    assert cgroup_cpu_limit(cgroup(tmp_path / "c", **v1)) == 2.0
    unlimited = {"cpu__cpu.cfs_quota_us": "-1", "cpu__cpu.cfs_period_us": "100000"}
    assert cgroup_cpu_limit(cgroup(tmp_path / "d", **unlimited)) is None
    assert cgroup_cpu_limit(tmp_path / "none") is None
    # a fraction of a CPU still gets a thread; the quota rounds up
    assert usable_cpus(cgroup(tmp_path / "e", **{"cpu.max": "50000 100000"})) == 1


def test_threads_are_the_share_of_the_usable_cpus(tmp_path: Path) -> None:
    root = cgroup(tmp_path, **{"cpu.max": "400000 100000"})
    cores = usable_cpus(root)  # 4, or fewer on a smaller machine
    assert inference_threads(Settings(), 64, root) == cores
    assert inference_threads(Settings(), 1, root) == 1  # never more than the runtime's own
    assert inference_threads(Settings(workers=2), 64, root) == max(1, cores // 2)
    assert inference_threads(Settings(torch_threads=7), 64, root) == 7


@pytest.fixture
def one_cpu_container(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(cpus, "CGROUP_ROOT", cgroup(tmp_path, **{"cpu.max": "100000 100000"}))
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_served_model_and_its_onnx_session_keep_to_the_containers_limit(
    one_cpu_container: None, bert_tiny_dir: Path, tmp_path: Path
) -> None:
    """torch and ONNX Runtime count the machine's cores: in a container limited to one CPU the
    sidecar must run one intra-op thread, not one per core of the node."""
    from limelight.app import load_served_model
    from limelight.runtimes.onnx_runtime import OnnxRuntime

    torch.set_num_threads(2)  # the machine's default here, whatever its size
    settings = Settings(model_dir=bert_tiny_dir, cache_dir=tmp_path / "cache")
    model = load_served_model(settings, progress=False)
    assert torch.get_num_threads() == 1
    runtime = OnnxRuntime.for_model(model, settings)
    assert runtime.session.get_session_options().intra_op_num_threads == 1

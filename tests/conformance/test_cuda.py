"""The CUDA path: the same answers on a GPU as on the CPU, for every method and the served head.

CI has no GPU, so these are skipped there; they run where one is present (`pytest
tests/conformance/test_cuda.py`, with the BERT-tiny demo model in the cache). The CPU is the
reference: each number the GPU gives is checked against the CPU's for the same model and text.
``LIMELIGHT_TEST_DEVICE`` names another device to hold against the CPU (``cuda:1``; ``cpu``
runs the checks themselves on a machine without a GPU).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from limelight.core.jobs import JobSpec
from limelight.jobs.runner import JobRunner
from limelight.methods.base import InlineMethod, MethodRegistry
from limelight.models.loaded import LoadedModel, load_model
from limelight.runtimes.base import InlineBatch, InlineOutputs
from limelight.runtimes.serving import torch_serving_runtime
from limelight.settings import Settings
from limelight_client import Client
from tests.conftest import RunningSidecar

DEVICE = os.environ.get("LIMELIGHT_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(
    DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="no CUDA device"
)

TEXTS = [
    "a gorgeous, witty, seductive movie",
    "an unwatchable, overwrought misfire of a film that never finds its footing",
    "not good",
]
# Cheap settings. The sampling methods (SLALOM, Shapley) draw their coalitions from NumPy, not
# from the device's generator, so both devices see the same ones.
PARAMS: dict[str, dict[str, Any]] = {
    "integrated_gradients": {"steps": 8},
    "slalom": {"num_samples": 64, "epochs": 5, "batch_size": 16},
}
METHODS = MethodRegistry.load()


def close(gpu: np.ndarray, cpu: np.ndarray, scale: float = 1.0) -> None:
    """float32 on two devices: kernels sum in other orders, so compare against the size of the
    values rather than bit for bit."""
    assert gpu.shape == cpu.shape
    assert np.isfinite(gpu).all()
    size = max(float(np.abs(cpu).max()), 1e-6)
    assert float(np.abs(gpu - cpu).max()) <= 2e-3 * scale * size


@pytest.fixture(scope="module")
def models(bert_tiny_dir: Path) -> tuple[LoadedModel, LoadedModel]:
    return load_model(bert_tiny_dir, "cpu"), load_model(bert_tiny_dir, DEVICE)


@pytest.fixture(scope="module")
def passes(models: tuple[LoadedModel, LoadedModel]) -> tuple[InlineOutputs, InlineOutputs]:
    """The served inline pass (the distilled head beside it) of one padded batch, per device."""
    cpu, gpu = models
    assert gpu.device.type == torch.device(DEVICE).type
    batch = InlineBatch.from_encoded([cpu.encode(t) for t in TEXTS], cpu.pad_id)
    runtimes = [torch_serving_runtime(m) for m in models]
    return runtimes[0].run_inline(batch), runtimes[1].run_inline(batch)


def test_the_inline_pass_on_the_gpu_is_the_cpus(
    passes: tuple[InlineOutputs, InlineOutputs],
) -> None:
    cpu, gpu = passes
    close(gpu.logits, cpu.logits)
    close(gpu.embedding_norms, cpu.embedding_norms)
    close(gpu.token_logits, cpu.token_logits)
    assert set(gpu.extra) == set(cpu.extra) and "distilled" in gpu.extra
    for name in cpu.extra:
        close(gpu.extra[name], cpu.extra[name])


@pytest.mark.parametrize("method_name", [n for n in METHODS.names() if n != "random"])
def test_every_method_on_the_gpu_is_the_cpus(
    method_name: str,
    models: tuple[LoadedModel, LoadedModel],
    passes: tuple[InlineOutputs, InlineOutputs],
    tmp_path: Path,
) -> None:
    method = METHODS.get(method_name)
    cpu, gpu = models
    if method.unavailable_reason(cpu):
        assert method.unavailable_reason(gpu), "a method is available on both devices or neither"
        pytest.skip(f"{method_name}: {method.unavailable_reason(cpu)}")
    if isinstance(method, InlineMethod):
        for row, text in enumerate(TEXTS):
            n = len(cpu.encode(text))
            close(method.attribute(passes[1], row, n), method.attribute(passes[0], row, n))
        return
    settings = Settings(jobs="off", drift_enabled=False, cache_dir=tmp_path)
    params = method.validate_params(PARAMS.get(method_name, {}))

    def run(model: LoadedModel) -> np.ndarray:
        runner = JobRunner(model, METHODS, settings)
        return runner.run(
            JobSpec(method=method_name, text=TEXTS[1], params=params)
        ).attribution.scores

    # SLALOM fits its surrogate by gradient descent: rounding differences grow over the steps.
    close(run(gpu), run(cpu), scale=10.0 if method_name == "slalom" else 1.0)


def test_a_sidecar_on_the_gpu_answers_as_one_on_the_cpu(
    start_sidecar: Callable[..., RunningSidecar], bert_tiny_dir: Path
) -> None:
    """End to end over gRPC: the served head inline and a job, on each device."""
    answers = []
    for device in ("cpu", DEVICE):
        sidecar = start_sidecar(model_dir=bert_tiny_dir, device=device, runtime="torch")
        with Client(sidecar.target, timeout=120) as client:
            inline = [client.explain(t, method="distilled", all_classes=True) for t in TEXTS]
            job = client.submit(TEXTS[1], "integrated_gradients", steps=8).result(timeout=120)
        answers.append((inline, job))
    (cpu_inline, cpu_job), (gpu_inline, gpu_job) = answers
    for c, g in zip(cpu_inline, gpu_inline, strict=True):
        assert g.label == c.label
        close(np.asarray(g.class_scores), np.asarray(c.class_scores))
        close(
            np.asarray(list(g.probabilities.values())), np.asarray(list(c.probabilities.values()))
        )
    close(np.asarray(gpu_job.scores), np.asarray(cpu_job.scores))

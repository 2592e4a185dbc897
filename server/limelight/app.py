"""Composition root: builds the model, runtime, methods, jobs, drift and service from Settings."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from limelight.core.service import DriftSink, ExplanationService, resolve_default_method
from limelight.demo.build import ensure_demo_model
from limelight.drift.monitor import DriftMonitor
from limelight.jobs.factory import create_backend
from limelight.jobs.priority import InlineGate
from limelight.jobs.runner import JobRunner
from limelight.methods.base import MethodRegistry
from limelight.metrics import Metrics
from limelight.models.loaded import LoadedModel, load_model
from limelight.runtimes.base import Runtime
from limelight.runtimes.serving import torch_serving_runtime, with_lexicon
from limelight.settings import Settings

if TYPE_CHECKING:
    from limelight.core.jobs import JobBackend

log = logging.getLogger(__name__)


def resolve_model_dir(settings: Settings, progress: bool = True) -> Path:
    """The configured model directory, or the demo model (built and cached on first use)."""
    if settings.model_dir is not None:
        return settings.model_dir
    return ensure_demo_model(settings.demo_model, settings.cache_dir, progress=progress)


def load_served_model(settings: Settings, progress: bool = True) -> LoadedModel:
    if settings.torch_threads > 0:
        import torch

        torch.set_num_threads(settings.torch_threads)
    return load_model(
        resolve_model_dir(settings, progress), device=settings.device, name=settings.model_name
    )


def build_runtime(settings: Settings, model: LoadedModel) -> Runtime:
    if settings.runtime == "onnx":
        from limelight.runtimes.onnx_runtime import OnnxRuntime

        return with_lexicon(OnnxRuntime.for_model(model, settings), model)
    return torch_serving_runtime(model)


def build_jobs(
    settings: Settings,
    model: LoadedModel,
    methods: MethodRegistry,
    metrics: Metrics,
    gate: InlineGate | None,
) -> JobBackend | None:
    return create_backend(settings, JobRunner(model, methods, settings), metrics, gate)


def build_drift(
    settings: Settings, model: LoadedModel, metrics: Metrics, method: str
) -> DriftSink | None:
    """The drift monitor of the served default inline method ``method`` (what it observes)."""
    if not settings.drift_enabled:
        return None
    return DriftMonitor(
        settings, list(model.labels), metrics, model_version=model.version, method=method
    )


@dataclass
class Application:
    settings: Settings
    model: LoadedModel
    metrics: Metrics
    service: ExplanationService


def build_application(
    settings: Settings, metrics: Metrics, model: LoadedModel | None = None
) -> Application:
    """Everything the sidecar serves; call ``service.start()`` inside the event loop."""
    model = model or load_served_model(settings)
    methods = MethodRegistry.load(settings)  # built-ins, plug-ins, configured (e.g. --lm-head)
    runtime = build_runtime(settings, model)
    gate = None
    jobs = None
    if settings.jobs != "off":
        gate = InlineGate()
        jobs = build_jobs(settings, model, methods, metrics, gate)
    service = ExplanationService(
        settings,
        model,
        runtime,
        methods,
        metrics,
        jobs=jobs,
        drift=build_drift(
            settings, model, metrics, resolve_default_method(settings.default_method, runtime)
        ),
        gate=gate,
    )
    metrics.model_info.info(
        {
            "name": model.name,
            "version": model.version,
            "architecture": model.architecture,
            "runtime": runtime.name,
            "labels": ",".join(model.labels),
        }
    )
    return Application(settings, model, metrics, service)

"""Composition root: builds the model, runtime, methods, jobs, drift and service from Settings."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from limelight.core.service import DriftSink, ExplanationService, resolve_default_method
from limelight.demo.build import ensure_demo_model
from limelight.drift.monitor import DriftMonitor
from limelight.drift.served import explainer_digest, served_identity
from limelight.errors import FailedPrecondition
from limelight.jobs.factory import create_backend
from limelight.jobs.priority import InlineGate
from limelight.jobs.runner import JobRunner
from limelight.locks import InUse
from limelight.methods.base import MethodRegistry
from limelight.metrics import Metrics
from limelight.models.loaded import LoadedModel, load_model
from limelight.runtimes.base import Runtime
from limelight.runtimes.serving import torch_serving_runtime, with_lexicon
from limelight.settings import Settings, job_backend_kind

if TYPE_CHECKING:
    from limelight.core.jobs import JobBackend

log = logging.getLogger(__name__)


def resolve_model_dir(settings: Settings, progress: bool = True, serving: bool = False) -> Path:
    """The configured model directory, or the demo model (built and cached on first use).
    ``serving``: a sidecar is about to serve it, so the demo's inline head and LM head (Decoded
    Grad-CAM jobs only) are built in the background instead of before the start; the sidecar
    serves NormXLogit until the inline head is written, then the head (``limelight.reload``)."""
    if settings.model_dir is not None:
        return settings.model_dir
    return ensure_demo_model(
        settings.demo_model,
        settings.cache_dir,
        progress=progress,
        lm_head="background" if serving else "now",
        inline_head="background" if serving else "now",
    )


def load_served_model(
    settings: Settings, progress: bool = True, serving: bool = False
) -> LoadedModel:
    import torch

    from limelight.cpus import inference_threads

    default = torch.get_num_threads()
    threads = inference_threads(settings, default)
    if threads != default:
        if settings.torch_threads == 0:
            log.info(
                "inference threads: %d (the CPUs this process may use), not %d", threads, default
            )
        torch.set_num_threads(threads)
    directory = resolve_model_dir(settings, progress, serving)
    cache = settings.cache_dir.expanduser()
    # Marked in use before it is read: a prune between the two would take it from under us.
    in_use = InUse().hold(
        [directory] if directory.resolve().parent == (cache / "models").resolve() else []
    )
    try:
        model = load_model(
            directory,
            device=settings.device,
            name=settings.model_name,
            default_max_tokens=settings.max_tokens,
        )
    except BaseException:
        in_use.release()
        raise
    # The graph and lexicon table this process may serve, by the model's version.
    model.in_use = in_use.hold([cache / "onnx" / model.version, cache / "lexicons" / model.version])
    return model


def build_runtime(settings: Settings, model: LoadedModel) -> Runtime:
    if settings.runtime == "onnx":
        from limelight.runtimes.onnx_runtime import OnnxRuntime

        return with_lexicon(OnnxRuntime.for_model(model, settings), model, settings.cache_dir)
    return torch_serving_runtime(model, settings.cache_dir)


def prepare_lexicon(settings: Settings, model: LoadedModel) -> Path | None:
    """With ``settings.lexicon_build``, build the lexicon table into the cache directory when
    the default method will serve it and none is there yet (once, even when several worker
    processes start together). Returns where a new table went, or None."""
    if not settings.lexicon_build or settings.default_method not in ("auto", "lexicon_lookup"):
        return None
    from limelight.models.explainer_head import inline_heads
    from limelight.models.lexicon_table import cached_lexicon_dir

    if settings.default_method == "auto" and inline_heads(model):
        return None  # the distilled head is served
    from limelight.methods.base import JobContext
    from limelight.methods.lexicon import ensure_lexicon

    out = cached_lexicon_dir(model, settings.cache_dir)
    context = JobContext(model=model, settings=settings, report=_log_tenths())
    try:
        card = ensure_lexicon(context, out, settings.cache_dir)
    except Exception as exc:
        if settings.default_method != "auto":  # asked for by name: it would refuse every request
            raise FailedPrecondition(
                f"default method lexicon_lookup: the lexicon table could not be built into "
                f"{out} ({exc}); set LIMELIGHT_CACHE_DIR to a writable directory, or build it "
                f"with `limelight lexicon --model {model.directory}`"
            ) from exc
        # `auto` serves the next method down: the sidecar stays useful, the log says why.
        log.exception("building the lexicon table into %s failed; serving without it", out)
        return None
    if card is None:
        return None
    log.info(
        "lexicon table built in %.1f s into %s: %s x %d (default method %s: lexicon_lookup)",
        card.seconds,
        out,
        f"{card.vocabulary:,}",
        card.num_labels,
        settings.default_method,
    )
    return out


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
        # No monitor sets the state: without this, the dashboard's state panel stays empty.
        for state in ("building", "ready", "disabled"):
            metrics.drift_reference_state.labels(state=state).set(float(state == "disabled"))
        return None
    return DriftMonitor(
        settings,
        list(model.labels),
        metrics,
        model_version=model.version,
        method=method,
        served=served_identity(settings, model, method),
    )


def _log_tenths() -> Callable[[float, str], None]:
    """A progress report that logs once per tenth of the work (server logs, not a bar)."""
    logged = [0]

    def report(fraction: float, message: str) -> None:
        if logged[0] == 0:
            log.info("building the lexicon table: %s", message)
        if int(fraction * 10) > logged[0]:
            logged[0] = int(fraction * 10)
            log.info("%s (%d %%)", message, round(fraction * 100))

    return report


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
    if settings.onnx_path is not None and settings.runtime != "onnx":
        # Easy to miss: the graph is given, the runtime flag forgotten, and torch serves.
        log.warning(
            "onnx_path %s is not used: the runtime is %s (--runtime onnx serves the graph)",
            settings.onnx_path,
            settings.runtime,
        )
    prepare_lexicon(settings, model)  # before anything reads which tables there are
    methods = MethodRegistry.load(settings)  # built-ins, plug-ins, configured (e.g. --lm-head)
    runtime = build_runtime(settings, model)
    gate = None
    jobs = None
    if job_backend_kind(settings.jobs) != "off":
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
    describe_model(metrics, model, runtime, service.default_method.name, settings)
    return Application(settings, model, metrics, service)


def describe_model(
    metrics: Metrics, model: LoadedModel, runtime: Runtime, method: str, settings: Settings
) -> None:
    """``limelight_model_info``: what is served, the default inline method included (it
    changes when a head or table written after the start is picked up: ``limelight.reload``),
    and a digest of the files its scores come from (the head or table; "" for methods that
    read none): two heads of one model told apart."""
    metrics.model_info.info(
        {
            "name": model.name,
            "version": model.version,
            "architecture": model.architecture,
            "runtime": runtime.name,
            "labels": ",".join(model.labels),
            "default_method": method,
            "method_files": explainer_digest(settings, model, method)[:16],
        }
    )

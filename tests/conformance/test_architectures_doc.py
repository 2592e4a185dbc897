"""docs/architectures.md covers the installed transformers, and its generator works."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

from limelight.models.adapters import REFUSED, sequence_classification_types

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architectures.md"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "architectures", ROOT / "scripts/architectures.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_installed_architecture_is_in_the_table() -> None:
    rows = dict(re.findall(r"^\| `([^`]+)` \| (\w+) \|", DOC.read_text(), flags=re.M))
    assert set(rows) == set(sequence_classification_types()), "regenerate docs/architectures.md"
    for model_type, reason in REFUSED.items():
        assert rows[model_type] == "refused", (model_type, reason)
    for named in ("modernbert", "electra", "albert", "mpnet", "longformer", "phi", "gemma"):
        assert rows[named] == "served"


def test_generator_rows() -> None:
    survey_one = generator().survey_one
    assert survey_one("funnel").status == "refused"
    bart = survey_one("bart")  # encoder-decoder: the decoder's state at the last token
    assert bart.status == "served" and "last pooling" in bart.detail
    served = survey_one("mpnet")
    assert served.status == "served" and "first pooling" in served.detail
    assert served.onnx == "yes"
    assert served.jobs == ""
    late = survey_one("eurobert")  # its default pooling: the mean of per-token logits
    assert late.status == "served" and "late pooling" in late.detail
    longformer = survey_one("longformer")
    assert longformer.status == "served" and longformer.jobs.startswith("decoded_gradcam: ")
    esm = survey_one("esm")  # token ids are rescaled: inputs_embeds changes the logits
    assert esm.status == "served" and esm.jobs.startswith("gradient, grad_x_input")


def test_readme_links_the_table() -> None:
    assert "docs/architectures.md" in (ROOT / "README.md").read_text()


def test_every_built_family_has_an_onnx_answer() -> None:
    """Exported and checked for parity, or refused with the reason: none left unchecked."""
    from limelight.models.adapters import supported_model_types
    from limelight.models.tiny import NOT_BUILT
    from limelight.runtimes.onnx_export import EXPORTABLE, NOT_EXPORTABLE

    unchecked = [
        t
        for t in supported_model_types()
        if t not in NOT_BUILT and t not in EXPORTABLE and t not in NOT_EXPORTABLE
    ]
    assert unchecked == []
    assert not set(EXPORTABLE) & set(NOT_EXPORTABLE)


def test_the_table_names_the_families_whose_head_kinds_are_checked() -> None:
    """The multi-label/regression paragraph is the generator's, over the families the head-kind
    conformance test runs."""
    rendered = generator().render([], "x").splitlines()
    paragraph = next(line for line in rendered if line.startswith("**Multi-label"))
    assert paragraph in (ROOT / "docs" / "architectures.md").read_text()
    from limelight.models.tiny import HEAD_KIND_FAMILIES

    assert all(f"`{family}`" in paragraph for family in HEAD_KIND_FAMILIES)

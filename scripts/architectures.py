"""Write docs/architectures.md: every sequence-classification architecture of the installed
transformers, served or refused by Limelight, with the reason.

Each architecture that is not refused up front is built as a tiny random-init classifier from
its default config (offline) and put through the same load-time check the sidecar runs: the
head derived from the model must reproduce the model's own logits within 1e-4 on a padded
probe batch.

    .venv/bin/python scripts/architectures.py [--out docs/architectures.md] [TYPE ...]
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _reason(message: str, model_type: str) -> str:
    for prefix in (f"architecture {model_type!r}: ", f"architecture {model_type!r} "):
        message = message.removeprefix(prefix)
    return message


@dataclass
class Row:
    model_type: str
    status: str  # served | refused | unverified
    detail: str
    onnx: str
    #: Job methods unavailable for this family besides LRP's and Decoded Grad-CAM's general
    #: conditions, with the reason ("" when none).
    jobs: str = ""
    #: Whether LRP propagates through this family.
    lrp: bool = False


def job_exceptions(adapter: object) -> str:
    """Job methods a served family cannot run, from what its adapter found on the probe."""
    out = []
    problem = getattr(adapter, "inputs_embeds_problem", "")
    if problem:
        out.append(f"gradient, grad_x_input, integrated_gradients: {problem}")
    if getattr(adapter, "hidden_state_copies", False):
        out.append(
            "decoded_gradcam: its hidden states are sliced copies of the tensors its blocks "
            "compute with"
        )
    return "; ".join(out)


def survey_one(model_type: str) -> Row:
    from limelight.errors import ModelLoadError
    from limelight.models.adapters import OVERRIDES, REFUSED, GenericAdapter, check_architecture
    from limelight.models.tiny import NOT_BUILT, tiny_model
    from limelight.runtimes.onnx_export import EXPORTABLE, NOT_EXPORTABLE

    onnx = "yes" if model_type in EXPORTABLE else NOT_EXPORTABLE.get(model_type, "not checked")
    if model_type in REFUSED:
        return Row(model_type, "refused", REFUSED[model_type], "—")
    if model_type in NOT_BUILT:
        return Row(
            model_type,
            "unverified",
            f"no tiny model here ({NOT_BUILT[model_type]}); a real checkpoint is served when "
            "it passes the load-time check",
            onnx,
        )
    try:
        model = tiny_model(model_type)
    except Exception as exc:  # report, do not stop the survey
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        return Row(model_type, "unverified", f"tiny config does not build: {first}", onnx)
    try:
        check_architecture(model.config)
        adapter = GenericAdapter(model).derive()
    except ModelLoadError as exc:
        return Row(model_type, "refused", _reason(exc.message, model_type), "—")
    from limelight.methods.lrp import unsupported_reason

    note = OVERRIDES[model_type].note if model_type in OVERRIDES else ""
    detail = adapter.derivation + (f"; {note}" if note else "")
    lrp = not unsupported_reason(model)
    return Row(model_type, "served", detail, onnx, job_exceptions(adapter), lrp)


#: How the input limit and padding are found (a paragraph of the page).
INPUT_LIMITS = (
    "**Input limits and padding.** A model's input limit is the least of its tokenizer's "
    "`model_max_length`, its config's `max_position_embeddings` and `n_positions`, and, where "
    "learned positions start past the padding index (RoBERTa and its kin: XLM-R, CamemBERT, "
    "Data2Vec-text, Longformer, MPNet, ESM, I-BERT, X-MOD, whose position ids run from "
    "`padding_idx + 1`), the rows of the position table less `padding_idx + 1`. Where none sets"
    " one (relative or ALiBi positions, e.g. T5 or BLOOM, with a tokenizer that declares no "
    "`model_max_length`) it is the served `max_tokens` (default 512), which caps it in every "
    "case. A config without `pad_token_id` (stock GPT-2) is given the pad id Limelight pads "
    "with at load, where that leaves the probe's logits unchanged (not where the tokenizer ends"
    " every text with that id), so that the classifier's own forward takes padded batches; "
    "Limelight's batched passes (the perturbation job methods, the throughput probe at submit, "
    "the distillation teacher) read the logits through the derived head at each row's last "
    "attended token, as the inline path does, and need no pad id "
    "(`tests/conformance/test_methods_x_architectures.py` runs every method on GPT-2 without "
    "one)."
)


def render(rows: list[Row], version: str) -> str:
    from limelight.models.tiny import HEAD_KIND_FAMILIES

    served = sum(r.status == "served" for r in rows)
    lrp = [f"`{r.model_type}`" for r in rows if r.lrp]
    lines = [
        "# Architectures",
        "",
        f"Generated by `scripts/architectures.py` from transformers {version}: every "
        f"architecture in its sequence-classification mapping ({len(rows)}), {served} served.",
        "",
        "**served**: a tiny random-init classifier of the family passed the load-time check — "
        "the head Limelight derives from the model (the modules beside the base, each applied "
        "to a one-token sequence, optionally after the base's pooler) reproduces the model's "
        "own logits within 1e-4 on a right-padded probe batch. The column says which head and "
        "which pooling were derived. A real checkpoint goes through the same check when it is "
        "loaded and is refused with one line if it fails. **refused**: with the reason. "
        "**unverified**: no tiny model could be built offline here.",
        "",
        "Inline methods (NormXLogit and the distilled head) apply to every served family, "
        "whatever its pooling: first token, last non-pad token, masked mean (ModernBERT and "
        'EuroBERT with `classifier_pooling="mean"`) or mean of per-token logits (EuroBERT\'s '
        'default `"late"`); the per-token forms are in '
        "[methods/normxlogit.md](methods/normxlogit.md). The served logits are the model's own "
        "under its pooling, and the gradient methods differentiate that same pooled logit.",
        "",
        "Job methods run on every served family except where the **job methods** column names "
        "one, with the reason (found on the same load-time probe), and these two general "
        f"conditions: LRP propagates through {', '.join(lrp)} only, and Decoded "
        "Grad-CAM needs a masked-LM head (`--lm-head` or a fitted one). The service refuses an "
        "unavailable method with FAILED_PRECONDITION and the reason before anything is queued. "
        "**ONNX**: `yes` where the export was checked for parity with torch on a tiny model "
        "(`limelight export-onnx`; every declared pooling), otherwise why not.",
        "",
        "**Multi-label and regression heads** (`problem_type` `multi_label_classification`, or "
        "one output) use the same derived head; only the link changes: a sigmoid per label, or "
        "the raw value. Checked against transformers' own outputs, with NormXLogit per label "
        "and its distance form, on "
        + ", ".join(f"`{f}`" for f in HEAD_KIND_FAMILIES)
        + " (`tests/conformance/test_heads_x_architectures.py`).",
        "",
        INPUT_LIMITS,
        "",
        "| architecture | status | head and pooling, or reason | job methods | ONNX |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        detail = r.detail.replace("|", "\\|")
        jobs = r.jobs.replace("|", "\\|") or ("all" if r.status == "served" else "—")
        lines.append(f"| `{r.model_type}` | {r.status} | {detail} | {jobs} | {r.onnx} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "architectures.md")
    parser.add_argument("types", nargs="*", help="only these (prints, does not write)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    from limelight.models.adapters import sequence_classification_types

    types = args.types or sequence_classification_types()
    rows = []
    for model_type in types:
        row = survey_one(model_type)
        print(f"{row.model_type:28s} {row.status:10s} {row.detail}", file=sys.stderr, flush=True)
        rows.append(row)
    if not args.types:
        args.out.write_text(render(rows, transformers.__version__))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

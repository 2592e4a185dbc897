"""Loading a local Hugging Face sequence classifier and tokenising with offsets."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedTokenizerBase,
)

from limelight.core.prediction import MULTI_LABEL, REGRESSION, SINGLE_LABEL, ProblemType
from limelight.core.types import Encoded
from limelight.errors import InvalidArgument, ModelLoadError
from limelight.locks import InUse
from limelight.models.adapters import (
    HeadAdapter,
    adapter_for,
    check_architecture,
    declare_pad_token,
)
from limelight.models.fingerprint import fingerprint
from limelight.models.sources import resolve_model_source
from limelight.models.tokenize import backend, to_encoded


@dataclass
class LoadedModel:
    """A served classifier: weights in eval mode, tokenizer, labels and its head adapter."""

    directory: Path
    name: str
    version: str
    model: Any  # transformers PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    adapter: HeadAdapter
    labels: list[str]
    max_tokens: int
    pad_id: int
    device: torch.device
    in_use: InUse | None = None
    """The shared locks on the cache folders this process uses for the model (its demo build,
    graph, lexicon table), held while it is loaded: ``limelight cache prune`` leaves them be."""

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def architecture(self) -> str:
        return str(self.config.model_type)

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def is_regression(self) -> bool:
        return self.num_labels == 1

    @property
    def problem_type(self) -> ProblemType:
        """``regression`` (one output), ``multi_label_classification`` (sigmoid per label, as
        the config says) or ``single_label_classification`` (softmax, the default)."""
        if self.is_regression:
            return REGRESSION
        if getattr(self.config, "problem_type", None) == MULTI_LABEL:
            return MULTI_LABEL
        return SINGLE_LABEL

    @property
    def is_multi_label(self) -> bool:
        return self.problem_type == MULTI_LABEL

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        return int(getattr(self.config, "num_attention_heads", 0) or 0)

    @property
    def hidden_size(self) -> int:
        return int(getattr(self.config, "hidden_size", 0) or getattr(self.config, "n_embd", 0))

    @property
    def mask_token_id(self) -> int | None:
        return self.tokenizer.mask_token_id  # type: ignore[no-any-return]

    def label_index(self, label: str) -> int:
        try:
            return self.labels.index(label)
        except ValueError:
            raise InvalidArgument(
                f"unknown label {label!r}; this model's labels are: {', '.join(self.labels)}"
            ) from None

    def encode(
        self,
        text: str,
        text_pair: str | None = None,
        max_tokens: int | None = None,
        truncation: Literal["truncate", "reject", "window"] = "truncate",
    ) -> Encoded:
        """Tokenise with character offsets, flagging special tokens and over-long input.

        Through private copies of the tokenizer's backend (``limelight.models.tokenize``):
        safe from any thread, whatever else is being tokenised at the time."""
        limit = min(max_tokens or self.max_tokens, self.max_tokens)
        enc = backend(self.tokenizer, None).encode(text, text_pair, add_special_tokens=True)
        truncated = False
        if len(enc.ids) > limit:
            if truncation == "reject":
                raise InvalidArgument(f"input has {len(enc.ids)} tokens; the limit is {limit}")
            enc = backend(self.tokenizer, limit).encode(text, text_pair, add_special_tokens=True)
            truncated = True
        paired = text_pair is not None
        return to_encoded(enc, paired, self.adapter.uses_token_type_ids, truncated)


def check_model_directory(model_dir: Path) -> None:
    """Refuse directories Limelight will not load: missing, no config, pickle-only, remote code."""
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise ModelLoadError(
            f"model directory {model_dir} does not exist; --model takes a local Hugging Face "
            "sequence-classification directory"
        )
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir} is not a directory; --model takes a model directory")
    if not (model_dir / "config.json").exists():
        raise ModelLoadError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    has_safetensors = any(model_dir.glob("*.safetensors"))
    if not has_safetensors:
        pickled = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
            p.name for p in model_dir.glob("*.pt")
        )
        found = f" (found {', '.join(pickled[:3])})" if pickled else ""
        raise ModelLoadError(
            f"{model_dir} has no .safetensors weights{found}; Limelight loads safetensors only "
            "(unpickling a checkpoint can run code): convert it once where you trust it, e.g. "
            'python -c "from transformers import AutoModelForSequenceClassification as M, '
            "AutoTokenizer as T; M.from_pretrained('SRC').save_pretrained('OUT', "
            "safe_serialization=True); T.from_pretrained('SRC').save_pretrained('OUT')\", "
            "then serve --model OUT"
        )
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{model_dir / 'config.json'} cannot be read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{model_dir / 'config.json'} is not a JSON object")
    if config.get("auto_map"):
        raise ModelLoadError(
            f"{model_dir} needs custom code (auto_map in config.json); Limelight never runs "
            "trust_remote_code: serve a model whose architecture is built into transformers"
        )


def check_trained(model_dir: Path, config: Any, missing: Iterable[str]) -> None:
    """Refuse a checkpoint that lacks weights of the sequence classifier: transformers fills
    them with random values and only logs it, so a masked-LM or token-classification directory
    given by mistake would otherwise serve random predictions (and explanations of them)."""
    missing = sorted(missing)
    if not missing:
        return
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    named = [str(a) for a in getattr(config, "architectures", None) or []]
    other = [a for a in named if not a.endswith("ForSequenceClassification")]
    what = f"; config.json names {', '.join(other)}, not a sequence classifier" if other else ""
    raise ModelLoadError(
        f"{model_dir}: the checkpoint lacks weights the sequence classifier needs ({shown}){what}; "
        "transformers would fill them with random values, so its predictions would mean "
        "nothing. Limelight serves a trained sequence-classification checkpoint "
        "(…ForSequenceClassification, saved with save_pretrained after fine-tuning)"
    )


@contextlib.contextmanager
def no_progress_bar() -> Iterator[None]:
    """transformers' loading bars off for the block: a bar per load fills a sidecar's log."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


PROBE_TEXTS = (
    "Limelight checks that the head it derives reproduces this classifier's own logits.",
    "A short probe.",
)


def probe_ids(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Token ids of the load-time probe (two texts of different lengths)."""
    return [list(tokenizer(text)["input_ids"]) for text in PROBE_TEXTS]


#: The input limit of a model whose config and tokenizer declare none (relative or ALiBi
#: positions: T5, BLOOM, with a tokenizer that sets no ``model_max_length``): the settings'
#: default ``max_tokens``.
DEFAULT_MAX_TOKENS = 512


def offset_position_limit(model: torch.nn.Module) -> int | None:
    """The most tokens a model's learned absolute positions can index where they start past
    the padding index (RoBERTa and its kin: XLM-R, CamemBERT, Longformer, MPNet, ESM, I-BERT,
    ...: position ids run from ``padding_idx + 1``, so a table of ``max_position_embeddings``
    rows holds ``max_position_embeddings - padding_idx - 1`` tokens); None for other models.
    Found generically: an embeddings module with an integer ``padding_idx`` beside its own
    ``position_embeddings`` table, as those families build theirs."""
    limits = []
    for module in model.modules():
        pad = getattr(module, "padding_idx", None)
        table = getattr(module, "position_embeddings", None)
        weight = getattr(table, "weight", None)
        if (
            isinstance(pad, int)
            and not isinstance(pad, bool)
            and pad >= 0
            and isinstance(table, torch.nn.Module)
            and isinstance(weight, torch.Tensor)
            and weight.dim() == 2
        ):
            limits.append(int(weight.shape[0]) - pad - 1)
    return min(limits) if limits else None


def input_limit(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    default: int = DEFAULT_MAX_TOKENS,
) -> int:
    """The most tokens one input may have: the least of the tokenizer's ``model_max_length``,
    the config's ``max_position_embeddings`` and ``n_positions`` and, for positions offset
    past the padding index, what the position table holds (:func:`offset_position_limit`);
    ``default`` where none of them sets a limit (relative or ALiBi positions)."""
    config = getattr(model, "config", None)
    limits = [
        tokenizer.model_max_length,
        getattr(config, "max_position_embeddings", None),
        getattr(config, "n_positions", None),
        offset_position_limit(model),
    ]
    known = [
        int(x)
        for x in limits
        if isinstance(x, int) and not isinstance(x, bool) and 0 < x < 1_000_000
    ]
    return min(known) if known else int(default)


def label_count_mismatch(model_dir: Path, config: Any) -> str:
    """Why a checkpoint's classifier does not fit its config.json, when its output layer has
    another number of outputs than the labels config.json declares (id2label or num_labels
    lost or edited); "" when that is not it. Reads the weights' shapes only (the headers of
    the safetensors files) against a weightless skeleton of the classifier."""
    try:
        from safetensors import safe_open

        with torch.device("meta"):
            skeleton = AutoModelForSequenceClassification.from_config(config)
        prefix = str(getattr(skeleton, "base_model_prefix", "") or "")
        declared = int(config.num_labels)
        head = {
            name: tuple(param.shape)
            for name, param in skeleton.named_parameters()
            if not (prefix and name.startswith(prefix + "."))
            and param.dim() >= 1
            and param.shape[0] == declared
        }
        for path in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as weights:
                for name in weights.keys():  # noqa: SIM118  (safe_open is no mapping)
                    if name not in head:
                        continue
                    shape = tuple(weights.get_slice(name).get_shape())
                    if shape and shape[0] != declared and shape[1:] == head[name][1:]:
                        return (
                            f"{model_dir}: config.json declares {declared} "
                            f"label{'s' if declared != 1 else ''} (id2label / num_labels) while "
                            f"the classifier weights ({name}) have {shape[0]} outputs; restore "
                            f"id2label (or num_labels) in config.json to the {shape[0]} labels "
                            "the classifier was trained with"
                        )
    except Exception:  # only an explanation of a failure already being reported
        return ""
    return ""


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {spec!r} requested but CUDA is not available")
    return device


def load_model(
    model_dir: Path | str,
    device: str = "cpu",
    name: str | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
) -> LoadedModel:
    """Load a local sequence-classification directory (safetensors only, no remote code), or
    a Hugging Face model id already in the local Hugging Face cache (never downloaded).

    ``default_max_tokens``: the model's input limit where neither its config nor its tokenizer
    sets one (pass the settings' ``max_tokens``); the settings' limit applies below the
    model's in any case."""
    source = resolve_model_source(model_dir)
    model_dir = source.path.resolve()
    name = name or source.name
    check_model_directory(model_dir)
    torch_device = resolve_device(device)
    try:
        config = AutoConfig.from_pretrained(
            model_dir, trust_remote_code=False, local_files_only=True
        )
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(
            f"{model_dir}: transformers cannot read its config.json ({_first_line(exc)})"
        ) from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            model_dir, trust_remote_code=False, local_files_only=True
        )
    except (ValueError, KeyError, OSError, TypeError) as exc:
        raise ModelLoadError(
            f"{model_dir}: cannot load its tokenizer ({_first_line(exc)})"
        ) from exc
    if not tokenizer.is_fast:
        raise ModelLoadError(f"{model_dir}: a fast (tokenizers) tokenizer is required for offsets")
    check_architecture(config)
    try:
        with no_progress_bar():  # a bar per load would fill a sidecar's log and the CLI's output
            model, loading = AutoModelForSequenceClassification.from_pretrained(
                model_dir,
                config=config,
                trust_remote_code=False,
                local_files_only=True,
                use_safetensors=True,
                output_loading_info=True,
            )
    except Exception as exc:  # transformers raises many types; one readable line for all
        mismatch = label_count_mismatch(model_dir, config)
        if mismatch:
            raise ModelLoadError(mismatch) from exc
        raise ModelLoadError(
            f"{model_dir}: transformers cannot load it as a {config.model_type!r} sequence "
            f"classifier ({type(exc).__name__}: {_first_line(exc)})"
        ) from exc
    check_trained(model_dir, config, loading.get("missing_keys") or ())
    model.eval().to(torch_device)
    probe = probe_ids(tokenizer)
    adapter = adapter_for(model, probe)
    id2label = getattr(config, "id2label", None) or {}
    labels = [str(id2label.get(i, f"LABEL_{i}")) for i in range(config.num_labels)]
    pad_id = config.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    # The classifier's own forward then takes padded batches of several rows (stock GPT-2
    # declares no pad id); kept only where it leaves the probe's logits as they were.
    declare_pad_token(model, int(pad_id), probe)
    max_tokens = input_limit(model, tokenizer, default_max_tokens)
    return LoadedModel(
        directory=model_dir,
        name=name or model_dir.name,
        version=fingerprint(model_dir),
        model=model,
        tokenizer=tokenizer,
        adapter=adapter,
        labels=labels,
        max_tokens=max_tokens,
        pad_id=int(pad_id),
        device=torch_device,
    )

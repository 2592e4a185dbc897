"""Open Inference Protocol (KServe v2) tensors <-> Limelight's domain types.

Shared by the gRPC servicer (``oip_grpc``) and the HTTP routes (``http``): both turn their wire
format into :class:`Tensor` objects, and this module turns those into ``ExplainInput`` requests
for the core service and its explanations back into output tensors. Every text in a request is
one ``ExplanationService.explain`` call, so the micro-batcher, drift and metrics are the same as
for ``limelight.v1.Explainer/Explain``.

Inputs (batch dimension first; shape ``[N]`` or ``[N, 1]``):

- ``text`` BYTES (UTF-8), required;
- ``text_pair`` BYTES, optional, same batch size (second segment of each input).

Outputs (``T`` is the longest token count in the batch; shorter rows are padded):

- ``probabilities`` FP32 ``[N, C]``, ``label`` BYTES ``[N]``, ``label_index`` INT64 ``[N]``;
- ``target_label`` BYTES ``[N]``: the class the attributions explain;
- ``tokens`` BYTES ``[N, T]`` (padding ``b""``), ``token_offsets`` INT64 ``[N, T, 2]`` (character
  ``start``/``end`` in the input text of the token's segment; padding ``-1``);
- ``attributions`` FP32 ``[N, T]`` (padding 0), ``num_tokens`` INT64 ``[N]``;
- ``predicted`` BOOL ``[N, C]``: the predicted labels (multi-label: every label over its
  threshold, ``probabilities`` being sigmoids; single-label: the one ``label``; regression: none);
- ``truncated`` BOOL ``[N]``: the text was cut at the token limit (only its start was explained),
  ``windows`` INT64 ``[N]``: how many windows explained it whole (``truncation=window``; else 0).

Request parameters: ``method`` (an inline method; default the server's), ``target`` (a class
label) or ``target_index`` (a class index); neither: the predicted class. A requested output may
carry ``binary_data`` (Triton's binary tensor extension) and no other parameter: Triton's
classification extension (``classification``, tritonclient's ``class_count``) and shared memory
are refused, not ignored. An output requested twice is refused.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from limelight.core.service import ExplanationService
from limelight.core.types import (
    Cost,
    ExplainInput,
    Explanation,
    ModelInfo,
    TargetSpec,
    TokenColumns,
)
from limelight.errors import InvalidArgument, LimelightError, NotFound
from limelight.settings import Settings

PLATFORM = "limelight"
SERVER_NAME = "limelight"
#: Extensions of the protocol both ports serve: model metadata with ``properties``, and the
#: explanation outputs.
SERVER_EXTENSIONS = ["model_metadata_properties", "explanations"]
#: The HTTP port's: also Triton's binary tensor extension (gRPC has ``raw_*_contents`` instead).
HTTP_SERVER_EXTENSIONS = [*SERVER_EXTENSIONS, "binary_tensor_data"]
#: The parameters a requested output may carry: ``binary_data`` (Triton's binary tensor
#: extension; the gRPC port always answers in ``raw_output_contents``).
OUTPUT_PARAMETERS = frozenset({"binary_data"})
INPUT_TEXT = "text"
INPUT_TEXT_PAIR = "text_pair"
PARAM_METHOD = "method"
PARAM_TARGET = "target"
PARAM_TARGET_INDEX = "target_index"

#: Output name -> (datatype, shape with -1 for variable dimensions; "C" is the class count).
OUTPUTS: dict[str, tuple[str, tuple[int | str, ...]]] = {
    "probabilities": ("FP32", (-1, "C")),
    "label": ("BYTES", (-1,)),
    "label_index": ("INT64", (-1,)),
    "target_label": ("BYTES", (-1,)),
    "tokens": ("BYTES", (-1, -1)),
    "token_offsets": ("INT64", (-1, -1, 2)),
    "attributions": ("FP32", (-1, -1)),
    "num_tokens": ("INT64", (-1,)),
    "predicted": ("BOOL", (-1, "C")),
    "truncated": ("BOOL", (-1,)),
    "windows": ("INT64", (-1,)),
}

#: Numpy dtypes of the fixed-size OIP datatypes (BYTES is an object array of ``bytes``).
NUMPY_DTYPES: dict[str, Any] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}


@dataclass
class Tensor:
    """One named tensor; ``data`` is flat or shaped, row-major (BYTES: ``bytes`` objects)."""

    name: str
    datatype: str
    shape: list[int]
    data: npt.NDArray[Any]


@dataclass
class InferRequest:
    model_name: str
    model_version: str = ""
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[str] | None = None
    """Requested output names; ``None``: all of them."""


@dataclass
class InferResponse:
    model_name: str
    model_version: str
    id: str
    outputs: list[Tensor]


# --- BYTES tensors in their binary form -----------------------------------------------------


def encode_bytes(items: Sequence[bytes]) -> bytes:
    """The binary BYTES encoding: each element as a 4-byte little-endian length, then bytes."""
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def too_many_items(
    count: int, max_items: int, what: str, at_least: bool = False
) -> InvalidArgument:
    """The refusal of a request of ``count`` texts (past ``max_batch_request_items``), given
    before they are converted one by one: a million empty texts in 4 MiB held the event loop,
    and with it every other call and the liveness probe, for seconds."""
    return InvalidArgument(
        f"{what} holds {'at least ' if at_least else ''}{count:,} texts; at most {max_items} "
        "in one request (max_batch_request_items)"
    )


def check_items(name: str, shape: Sequence[int], max_items: int | None) -> None:
    """Refuse an input whose declared shape holds more elements than a request may carry."""
    if max_items is None or any(d < 0 for d in shape):
        return  # a negative dimension is refused with the shape's own message
    count = math.prod(shape)
    if count > max_items:
        raise too_many_items(count, max_items, f"input {name!r}")


def decode_bytes(raw: bytes, max_items: int | None = None) -> list[bytes]:
    """The elements of a binary BYTES tensor (4-byte little-endian length, then the bytes);
    more than ``max_items`` of them are refused as soon as they are seen."""
    items: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if max_items is not None and len(items) == max_items:
            raise too_many_items(max_items + 1, max_items, "a BYTES tensor", at_least=True)
        if offset + 4 > len(raw):
            raise InvalidArgument("malformed BYTES tensor: truncated length prefix")
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise InvalidArgument("malformed BYTES tensor: element longer than the data")
        items.append(bytes(raw[offset : offset + size]))
        offset += size
    return items


def tensor_from_raw(
    name: str, datatype: str, shape: Sequence[int], raw: bytes, max_items: int | None = None
) -> Tensor:
    """A tensor from its binary representation (gRPC ``raw_*_contents``, HTTP binary data);
    more elements than ``max_items`` (declared or found) are refused before decoding."""
    check_items(name, shape, max_items)
    if datatype == "BYTES":
        data: npt.NDArray[Any] = np.array(decode_bytes(raw, max_items) or [], dtype=object)
    elif datatype in NUMPY_DTYPES:
        dtype = np.dtype(NUMPY_DTYPES[datatype]).newbyteorder("<")
        if len(raw) % dtype.itemsize:
            raise InvalidArgument(f"input {name!r}: {len(raw)} bytes is not a whole {datatype}")
        data = np.frombuffer(raw, dtype=dtype)
    else:
        raise InvalidArgument(f"input {name!r}: unknown datatype {datatype!r}")
    return Tensor(name, datatype, list(shape), data)


def tensor_to_raw(tensor: Tensor) -> bytes:
    if tensor.datatype == "BYTES":
        return encode_bytes([bytes(x) for x in tensor.data.reshape(-1)])
    dtype = np.dtype(NUMPY_DTYPES[tensor.datatype]).newbyteorder("<")
    return np.ascontiguousarray(tensor.data, dtype=dtype).tobytes()


# --- requests ---------------------------------------------------------------------------------


def configured_model_name(settings: Settings) -> str | None:
    """The name the model of ``settings`` will be served under, known before it loads (what
    ``load_served_model`` names it): ``model_name``; else the model directory's name (a
    Hugging Face model id's last part); else the demo model's cache directory's name. None
    where it cannot be worked out."""
    if settings.model_name:
        return settings.model_name
    try:
        if settings.model_dir is not None:
            from limelight.models.sources import parse_hub_id

            path = Path(settings.model_dir).expanduser()
            if path.exists():
                return path.resolve().name or None
            parsed = parse_hub_id(str(settings.model_dir))
            return (parsed[0].rsplit("/", 1)[-1] if parsed else path.name) or None
        from limelight.demo.recipes import demo_model_dir

        return demo_model_dir(settings.demo_model, settings.cache_dir).name
    except (OSError, ValueError, LimelightError):
        return None


def unknown_model(name: str, served: str | None) -> NotFound:
    """``name`` is not served; ``served`` (the name that is) only to a caller who may know it."""
    if served is None:
        return NotFound(f"unknown model {name!r}")
    return NotFound(f"unknown model {name!r}; this server serves {served!r}")


def check_model(info: ModelInfo, name: str, version: str = "", reveal: bool = True) -> None:
    """NotFound unless ``name`` (and ``version``, if given) is the served model. ``reveal``:
    the answer may name the served model and version (auth is off, or the caller sent an
    accepted token); false on the routes open to anyone while auth is on."""
    if name != info.name:
        raise unknown_model(name, info.name if reveal else None)
    if version and version != info.version:
        served = f"; the served version is {info.version!r}" if reveal else ""
        raise NotFound(f"unknown version {version!r} of model {name!r}{served}")


def check_output_parameters(output: str, parameters: Mapping[str, Any]) -> None:
    """InvalidArgument for a requested output's parameter this server does not honour (rather
    than answering as if it had not been given)."""
    for key in parameters:
        if key not in OUTPUT_PARAMETERS:
            why = (
                " (Triton's classification extension, tritonclient's class_count, is not "
                "served: ask for the output whole)"
                if key == "classification"
                else ""
            )
            raise InvalidArgument(
                f"output {output!r}: parameter {key!r} is not supported{why}; an output takes "
                f"only {', '.join(sorted(OUTPUT_PARAMETERS))}"
            )


def _texts(tensor: Tensor) -> list[str]:
    if tensor.datatype != "BYTES":
        raise InvalidArgument(
            f"input {tensor.name!r} must have datatype BYTES (UTF-8 text), not {tensor.datatype!r}"
        )
    shape = list(tensor.shape)
    if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1) or shape[0] < 1:
        raise InvalidArgument(
            f"input {tensor.name!r} must have shape [N] or [N, 1] with N >= 1, not {shape}"
        )
    flat = tensor.data.reshape(-1)
    if flat.size != shape[0]:
        raise InvalidArgument(f"input {tensor.name!r} has shape {shape} but {flat.size} elements")
    texts = []
    for item in flat:
        raw = item if isinstance(item, bytes | bytearray) else str(item).encode()
        try:
            texts.append(bytes(raw).decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise InvalidArgument(f"input {tensor.name!r} is not valid UTF-8: {exc}") from None
    return texts


def method_and_target(parameters: Mapping[str, Any]) -> tuple[str, TargetSpec | None]:
    """The request parameters ``method``, ``target`` and ``target_index``, checked."""
    method = parameters.get(PARAM_METHOD, "")
    if not isinstance(method, str):
        raise InvalidArgument(f"parameter {PARAM_METHOD!r} must be a string")
    return method, _target(parameters)


def _target(parameters: Mapping[str, Any]) -> TargetSpec | None:
    label = parameters.get(PARAM_TARGET)
    index = parameters.get(PARAM_TARGET_INDEX)
    if label is not None and index is not None:
        raise InvalidArgument(f"give {PARAM_TARGET!r} or {PARAM_TARGET_INDEX!r}, not both")
    if label is not None:
        if not isinstance(label, str):
            raise InvalidArgument(f"parameter {PARAM_TARGET!r} must be a string (a class label)")
        return TargetSpec(label=label)
    if index is not None:
        if isinstance(index, bool) or not isinstance(index, int):
            raise InvalidArgument(f"parameter {PARAM_TARGET_INDEX!r} must be an integer")
        return TargetSpec(index=index)
    return None


def explain_inputs(request: InferRequest, deadline: float | None) -> list[ExplainInput]:
    """One ``ExplainInput`` per text of the batch."""
    by_name: dict[str, Tensor] = {}
    for tensor in request.inputs:
        if tensor.name in by_name:
            raise InvalidArgument(f"input {tensor.name!r} is given twice")
        if tensor.name not in (INPUT_TEXT, INPUT_TEXT_PAIR):
            raise InvalidArgument(
                f"unknown input {tensor.name!r}; the inputs are {INPUT_TEXT!r} (BYTES) and "
                f"the optional {INPUT_TEXT_PAIR!r} (BYTES)"
            )
        by_name[tensor.name] = tensor
    if INPUT_TEXT not in by_name:
        raise InvalidArgument(f"missing input {INPUT_TEXT!r} (BYTES, shape [N] or [N, 1])")
    texts = _texts(by_name[INPUT_TEXT])
    pairs: list[str | None] = [None] * len(texts)
    if INPUT_TEXT_PAIR in by_name:
        pairs = list(_texts(by_name[INPUT_TEXT_PAIR]))
        if len(pairs) != len(texts):
            raise InvalidArgument(
                f"{INPUT_TEXT_PAIR!r} has {len(pairs)} elements but {INPUT_TEXT!r} has {len(texts)}"
            )
    method, target = method_and_target(request.parameters)
    asked: set[str] = set()
    for name in request.outputs or ():
        if name not in OUTPUTS:
            raise InvalidArgument(f"unknown output {name!r}; the outputs are {', '.join(OUTPUTS)}")
        if name in asked:
            raise InvalidArgument(f"output {name!r} is requested twice")
        asked.add(name)
    return [
        ExplainInput(
            text=text,
            text_pair=pair,
            target=target,
            method=method,
            request_id=request.id,
            deadline=deadline,
        )
        for text, pair in zip(texts, pairs, strict=True)
    ]


async def infer(
    service: ExplanationService,
    request: InferRequest,
    deadline: float | None,
    caller: str | None = None,
) -> InferResponse:
    """Validate, explain every text through the core service (micro-batched, within
    ``caller``'s share of the backlog), build outputs."""
    info = service.model_info()
    check_model(info, request.model_name, request.model_version)
    explanations = await service.explain_batch(explain_inputs(request, deadline), caller)
    return InferResponse(
        model_name=info.name,
        model_version=info.version,
        id=request.id,
        outputs=output_tensors(explanations, request.outputs),
    )


# --- responses --------------------------------------------------------------------------------


def output_tensors(
    explanations: Sequence[Explanation], names: Sequence[str] | None
) -> list[Tensor]:
    n = len(explanations)
    width = max(len(e.tokens) for e in explanations)
    tokens = np.full((n, width), b"", dtype=object)
    offsets = np.full((n, width, 2), -1, dtype=np.int64)
    scores = np.zeros((n, width), dtype=np.float32)
    for row, e in enumerate(explanations):
        columns = TokenColumns.of(e.tokens)
        count = len(columns)
        tokens[row, :count] = [text.encode() for text in columns.texts]
        offsets[row, :count] = columns.offsets
        scores[row, :count] = e.attribution.scores
    values: dict[str, npt.NDArray[Any]] = {
        "probabilities": np.array([e.probabilities for e in explanations], dtype=np.float32),
        "label": np.array([e.label.encode() for e in explanations], dtype=object),
        "label_index": np.array([e.label_index for e in explanations], dtype=np.int64),
        "target_label": np.array(
            [e.attribution.target_label.encode() for e in explanations], dtype=object
        ),
        "tokens": tokens,
        "token_offsets": offsets,
        "attributions": scores,
        "num_tokens": np.array([len(e.tokens) for e in explanations], dtype=np.int64),
        "predicted": np.array(
            [[name in e.predicted_labels for name in e.labels] for e in explanations],
            dtype=np.bool_,
        ),
        "truncated": np.array([e.truncated for e in explanations], dtype=np.bool_),
        "windows": np.array([e.windows for e in explanations], dtype=np.int64),
    }
    return [
        Tensor(name, OUTPUTS[name][0], list(values[name].shape), values[name])
        for name in (names or list(OUTPUTS))
    ]


def _shape(shape: tuple[int | str, ...], classes: int) -> list[int]:
    return [classes if d == "C" else int(d) for d in shape]


@dataclass
class TensorMetadata:
    name: str
    datatype: str
    shape: list[int]


@dataclass
class ModelMetadata:
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]
    properties: dict[str, str]


def model_metadata(info: ModelInfo) -> ModelMetadata:
    """What ModelMetadata reports: tensors, and as properties the request parameters."""
    inline = [m.name for m in info.methods if m.cost is Cost.INLINE and not m.unavailable_reason]
    return ModelMetadata(
        name=info.name,
        versions=[info.version],
        platform=PLATFORM,
        inputs=[
            TensorMetadata(INPUT_TEXT, "BYTES", [-1]),
            TensorMetadata(INPUT_TEXT_PAIR, "BYTES", [-1]),
        ],
        outputs=[
            TensorMetadata(name, datatype, _shape(shape, len(info.labels)))
            for name, (datatype, shape) in OUTPUTS.items()
        ],
        properties={
            "labels": ",".join(info.labels),
            "architecture": info.architecture,
            "runtime": info.runtime,
            "default_method": info.default_method,
            "parameter.method": "string, one of: " + ",".join(inline),
            "parameter.target": "string, a class label (default: the predicted class)",
            "parameter.target_index": "int64, a class index (default: the predicted class)",
            "input.text_pair": "optional; "
            + ("supported" if info.supports_text_pair else "not supported by this model"),
            "max_tokens": str(info.max_tokens),
            "max_text_chars": str(info.max_text_chars),
            "problem_type": info.problem_type,
            **(
                {"thresholds": ",".join(f"{t:g}" for t in info.thresholds)}
                if info.thresholds
                else {}
            ),
        },
    )

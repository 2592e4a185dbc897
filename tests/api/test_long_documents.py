"""``truncation=window``: a text far over the token limit is explained whole, in overlapping
windows, checked against classifying and explaining each window alone with transformers."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, BertForSequenceClassification

from limelight_client import Client
from limelight_client.errors import InvalidArgument
from tests.conftest import windowed

LIMIT, STRIDE = 32, 8
SENTENCE = (
    "the service was slow but the food arrived warm and the staff apologised twice while "
    "the manager offered a discount that nobody had asked for and the evening ended well"
)
WORDS = SENTENCE.split(" ")
TEXT = " ".join(WORDS[i % len(WORDS)] + ("," if i % 11 == 10 else "") for i in range(160))


def _windows_alone(model_dir: Path, text: str) -> list[dict[str, Any]]:
    """Each window classified and explained on its own: logits [C], NormXLogit [n, C], offsets."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = BertForSequenceClassification.from_pretrained(model_dir).eval()
    enc = tokenizer(
        text,
        truncation=True,
        max_length=LIMIT,
        stride=STRIDE,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
    )
    out = []
    for w, ids in enumerate(enc["input_ids"]):
        with torch.no_grad():
            res = model(torch.tensor([ids]), output_hidden_states=True)
            h0, h_last = res.hidden_states[0][0], res.hidden_states[-1][0]
            pooled = model.bert.pooler.activation(model.bert.pooler.dense(h_last))
            normx = (h0.norm(dim=-1, keepdim=True) * model.classifier(pooled)).numpy()
        out.append(
            {
                "logits": res.logits[0].numpy(),
                "normx": normx,
                "offsets": [tuple(o) for o in enc["offset_mapping"][w]],
                "special": enc["special_tokens_mask"][w],
            }
        )
    return out


def test_a_long_text_is_explained_whole(
    start_sidecar: Callable[..., Any], random_bert_dir: Path
) -> None:
    running = start_sidecar(
        model_dir=random_bert_dir, **windowed(LIMIT, STRIDE, max_batch_tokens=4 * LIMIT)
    )
    alone = _windows_alone(random_bert_dir, TEXT)
    assert len(alone) > 5
    with Client(running.target, timeout=120) as client:
        result = client.explain(TEXT, method="normxlogit", all_classes=True)
        short = client.explain("the food arrived warm", method="normxlogit")
        pair = client.explain(TEXT, text_pair="was it good?", method="normxlogit")
    assert result.windows == len(alone) and not result.truncated
    assert short.windows == 0 and pair.windows == 0 and pair.truncated

    # The prediction: softmax of the mean of the windows' logits.
    mean = np.mean([a["logits"] for a in alone], axis=0)
    expected = np.exp(mean - mean.max()) / np.exp(mean - mean.max()).sum()
    np.testing.assert_allclose(list(result.probabilities.values()), expected, rtol=1e-4)

    # Every word of the text is covered by a token, in order, once.
    content = [t for t in result.tokens if not t.special]
    starts = [t.start for t in content]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    covered = {i for t in content for i in range(t.start, t.end)}
    for match in re.finditer(r"\S", TEXT):
        assert match.start() in covered
    assert result.tokens[0].special and result.tokens[-1].special

    # Scores: each window's own NormXLogit; the mean of the two where windows overlap.
    by_offset: dict[tuple[int, int], list[np.ndarray]] = {}
    for a in alone:
        for row, (offset, special) in enumerate(zip(a["offsets"], a["special"], strict=True)):
            if not special:
                by_offset.setdefault(offset, []).append(a["normx"][row])
    assert any(len(v) == 2 for v in by_offset.values())  # the overlaps
    assert result.class_scores is not None
    for index, tok in enumerate(result.tokens):
        if tok.special:
            continue
        want = np.mean(by_offset[(tok.start, tok.end)], axis=0)
        np.testing.assert_allclose(result.class_scores[index], want, rtol=1e-4, atol=1e-5)
    target = result.labels.index(result.target_label)
    np.testing.assert_allclose(
        result.scores, [row[target] for row in result.class_scores], rtol=1e-6
    )
    np.testing.assert_allclose(result.scores[0], alone[0]["normx"][0][target], rtol=1e-4)
    np.testing.assert_allclose(result.scores[-1], alone[-1]["normx"][-1][target], rtol=1e-4)

    # The batcher counted windows: the batch sizes it recorded add up to every window.
    with urllib.request.urlopen(running.metrics_url, timeout=10) as response:
        metrics = response.read().decode()
    total = re.search(r"^limelight_batch_size_sum ([0-9.e+]+)$", metrics, re.M)
    assert total is not None and float(total.group(1)) == len(alone) + 1 + 1  # + short, pair

    # A KServe v1 client gets the same stitched tokens and scores from the HTTP port.
    body = {"instances": [TEXT], "parameters": {"method": "normxlogit"}}
    request = urllib.request.Request(
        f"http://127.0.0.1:{running.server.metrics_port}/v1/models/{random_bert_dir.name}:explain",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        (v1,) = json.loads(response.read())["explanations"]
    assert [(t["text"], t["start"], t["end"], t["special"]) for t in v1["tokens"]] == [
        (t.text, t.start, t.end, t.special) for t in result.tokens
    ]
    np.testing.assert_allclose([t["score"] for t in v1["tokens"]], result.scores, rtol=1e-5)
    # ... and says, as the gRPC answer does, how the text was read: whole in windows, or cut.
    assert (v1["windows"], v1["truncated"]) == (len(alone), False)
    root = f"http://127.0.0.1:{running.server.metrics_port}"
    pair_body = {"instances": [{"text": TEXT, "text_pair": "was it good?"}]}
    request = urllib.request.Request(
        f"{root}/v1/models/{random_bert_dir.name}:predict", data=json.dumps(pair_body).encode()
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        (cut,) = json.loads(response.read())["predictions"]
    assert (cut["windows"], cut["truncated"]) == (0, True)  # pairs are not windowed
    v2_body = {
        "inputs": [
            {"name": "text", "datatype": "BYTES", "shape": [2], "data": [TEXT, "warm food"]}
        ],
        "outputs": [{"name": "windows"}, {"name": "truncated"}],
    }
    request = urllib.request.Request(
        f"{root}/v2/models/{random_bert_dir.name}/infer", data=json.dumps(v2_body).encode()
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        outputs = {o["name"]: o for o in json.loads(response.read())["outputs"]}
    assert outputs["windows"]["datatype"] == "INT64"
    assert outputs["windows"]["data"] == [len(alone), 0]
    assert outputs["truncated"]["datatype"] == "BOOL"
    assert outputs["truncated"]["data"] == [False, False]


def test_max_aggregation_and_limits(
    start_sidecar: Callable[..., Any], random_bert_dir: Path
) -> None:
    running = start_sidecar(
        model_dir=random_bert_dir,
        **windowed(LIMIT, STRIDE, window_aggregation="max", max_text_chars=len(TEXT)),
    )
    alone = _windows_alone(random_bert_dir, TEXT)
    top = np.max([a["logits"] for a in alone], axis=0)
    expected = np.exp(top - top.max()) / np.exp(top - top.max()).sum()
    with Client(running.target, timeout=120) as client:
        result = client.explain(TEXT, method="normxlogit")
        with pytest.raises(InvalidArgument, match="the limit is"):
            client.explain(TEXT + " more", method="normxlogit")
    np.testing.assert_allclose(list(result.probabilities.values()), expected, rtol=1e-4)
    assert "overlapping windows" in result.to_terminal(color=False)


def test_a_stride_over_half_the_window_is_refused(
    start_sidecar: Callable[..., Any], random_bert_dir: Path
) -> None:
    with pytest.raises(Exception, match="window_stride 20 must be between 0 and"):
        start_sidecar(model_dir=random_bert_dir, **windowed(LIMIT, 20))


def test_a_job_on_a_long_text_runs_on_every_window(
    start_sidecar: Callable[..., Any], random_bert_dir: Path
) -> None:
    """Jobs follow the same policy: the method runs on each window alone, stitched back."""
    from limelight.core.windows import encode_windows
    from limelight.methods.base import JobContext, JobMethod, MethodRegistry
    from limelight.models.loaded import load_model
    from limelight.settings import Settings

    running = start_sidecar(model_dir=random_bert_dir, **windowed(LIMIT, STRIDE))
    with Client(running.target, timeout=120) as client:
        done = client.submit(TEXT, "grad_x_input", target="positive").result(timeout=300)
        inline = client.explain(TEXT, method="normxlogit")
    assert done.windows == inline.windows > 5
    assert [(t.start, t.end) for t in done.tokens] == [(t.start, t.end) for t in inline.tokens]
    assert done.details["windows"] == done.windows
    np.testing.assert_allclose(
        list(done.probabilities.values()), list(inline.probabilities.values()), rtol=1e-4
    )
    # Each window explained alone by the same method, stitched here by character offsets.
    model = load_model(random_bert_dir)
    settings = Settings(jobs="off")
    method = MethodRegistry.load(settings).get("grad_x_input")
    assert isinstance(method, JobMethod)
    ctx = JobContext(model, settings)
    target = model.labels.index("positive")
    by_offset: dict[tuple[int, int], list[float]] = {}
    for window in encode_windows(model, TEXT, LIMIT, STRIDE):
        scores = method.run(ctx, window, target, method.validate_params({})).scores
        for tok, score in zip(window.tokens, scores, strict=True):
            if not tok.special:
                by_offset.setdefault((tok.start, tok.end), []).append(float(score))
    for token, score in zip(done.tokens, done.scores, strict=True):
        if not token.special:
            want = float(np.mean(by_offset[(token.start, token.end)]))
            assert score == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_window_layout_stitches_by_offsets_in_text_order() -> None:
    from limelight.core.types import Encoded, TokenInfo
    from limelight.core.windows import WindowLayout, aggregate_logits

    def window(spans: list[tuple[int, int]]) -> Encoded:
        tokens = [TokenInfo("[CLS]", 1, 0, 0, True)]
        tokens += [TokenInfo(f"t{a}", 10 + a, a, b, False) for a, b in spans]
        tokens.append(TokenInfo("[SEP]", 2, 0, 0, True))
        return Encoded([t.id for t in tokens], None, tokens, False)

    first, second = window([(0, 3), (4, 7), (8, 11)]), window([(8, 11), (12, 15)])
    for order in ([first, second], [second, first]):  # left truncation returns them reversed
        layout = WindowLayout.of(order)
        assert [(t.start, t.end) for t in layout.tokens[1:-1]] == [
            (0, 3),
            (4, 7),
            (8, 11),
            (12, 15),
        ]
        assert layout.tokens[0].special and layout.tokens[-1].special
    layout = WindowLayout.of([first, second])
    a = np.array([[0.0], [1.0], [2.0], [3.0], [9.0]], dtype=np.float32)  # first window's rows
    b = np.array([[5.0], [5.0], [7.0], [8.0]], dtype=np.float32)
    np.testing.assert_allclose(layout.stitch([a, b])[:, 0], [0.0, 1.0, 2.0, 4.0, 7.0, 8.0])
    logits = [np.array([1.0, -1.0], dtype=np.float32), np.array([3.0, -5.0], dtype=np.float32)]
    assert aggregate_logits(logits, "mean").tolist() == [2.0, -3.0]
    assert aggregate_logits(logits, "max").tolist() == [3.0, -1.0]

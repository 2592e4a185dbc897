"""The web explanation viewer on the HTTP port: its JSON routes with a real HTTP client, bearer
tokens, the flag that turns it off, and the page itself in headless Chromium (Selenium with
Debian's chromium-driver) against a real sidecar serving a small random BERT."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from limelight.api.viewer import word_spans
from limelight.core.types import TokenInfo
from limelight_client import Client
from tests.browser import needs_browser, wait
from tests.conftest import RunningSidecar, two_token_sidecar
from tests.pki import make_pki
from tests.tiny_bert import save_tiny_bert

INJECTION = '<img src=x onerror="window.__pwned=1">'
INJECTION_SCRIPT = "<script>window.__pwned=2</script>"
TEXT = "a gorgeous, witty, seductive movie"


def base(sidecar: RunningSidecar) -> str:
    return f"http://127.0.0.1:{sidecar.server.metrics_port}"


def call(
    url: str,
    body: Any = None,
    token: str | None = None,
    content_type: str = "application/json",
) -> tuple[int, Any, dict[str, str]]:
    data = (
        None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    )
    request = urllib.request.Request(url, data=data)
    if data is not None:
        request.add_header("Content-Type", content_type)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            raw = response.read()
            headers = dict(response.headers)
            status = response.status
    except urllib.error.HTTPError as exc:
        raw, headers, status = exc.read(), dict(exc.headers), exc.code
    try:
        return status, json.loads(raw), headers
    except ValueError:
        return status, raw.decode(errors="replace"), headers


def wait_job(url: str, token: str | None = None) -> dict[str, Any]:
    while True:
        status, job, _ = call(url, token=token)
        assert status == 200, job
        if job["terminal"]:
            return job
        time.sleep(0.1)


@pytest.fixture
def viewer_sidecar(
    start_sidecar: Callable[..., RunningSidecar], random_bert_dir: Path
) -> RunningSidecar:
    """The cheapest real sidecar: a tiny random 3-class BERT with a real WordPiece tokenizer."""
    return start_sidecar(model_dir=random_bert_dir, viewer_drift_sample_s=0)


# --- pure helpers ------------------------------------------------------------------------------


def test_word_spans_join_touching_pieces_per_segment() -> None:
    def tok(text: str, start: int, end: int, special: bool = False, segment: int = 0) -> TokenInfo:
        return TokenInfo(text, 0, start, end, special, segment)

    tokens = [
        tok("[CLS]", 0, 0, True),
        tok("gor", 0, 3),
        tok("##geous", 3, 8),
        tok(",", 8, 9),
        tok("(", 10, 11),
        tok("don", 11, 14),
        tok("'", 14, 15),
        tok("t", 15, 16),
        tok(")", 16, 17),
        tok("[SEP]", 0, 0, True),
        tok("a", 0, 1, segment=1),
        tok("...", 2, 5, segment=1),
        tok("[SEP]", 0, 0, True),
    ]
    words = word_spans(tokens, "gorgeous, (don't)", "a ...")
    assert [(w["text"], w["tokens"], w["segment"]) for w in words] == [
        ("gorgeous", [1, 2], 0),
        (",", [3], 0),
        ("(", [4], 0),
        ("don't", [5, 6, 7], 0),  # an apostrophe between letters stays inside the word
        (")", [8], 0),
        ("a", [10], 1),
        ("...", [11], 1),
    ]
    assert [(w["start"], w["end"]) for w in words[:2]] == [(0, 8), (8, 9)]


def test_word_spans_keep_the_pieces_of_one_character_in_its_word() -> None:
    """An uncased WordPiece cuts each Hangul syllable into its letters, each with the
    syllable's span: "정말" is one word, not "정", "정", "정말", "말", "말"."""
    spans = [(0, 1), (0, 1), (0, 1), (1, 2), (1, 2), (1, 2), (3, 5)]
    tokens = [TokenInfo("[CLS]", 0, 0, 0, True, 0)]
    tokens += [TokenInfo("x", 0, start, end, False, 0) for start, end in spans]
    tokens.append(TokenInfo("[SEP]", 0, 0, 0, True, 0))
    words = word_spans(tokens, "정말 좋아")
    assert [(w["text"], w["tokens"], w["start"], w["end"]) for w in words] == [
        ("정말", [1, 2, 3, 4, 5, 6], 0, 2),
        ("좋아", [7], 3, 5),
    ]


#: Texts whose words the viewer and the SDK must agree on: CJK without spaces, punctuation
#: inside runs, kana, Hangul, emoji, accents, ASCII symbols, a text pair.
AGREEING_TEXTS = [
    ("这部电影非常好看，演员很棒。", None),
    ("素晴らしい映画でした", "a great film。很好看"),
    ("it was good,but boring...really dull", "don't (stop) $5+tax ~ok~"),
    ("정말 좋아 cafe\u0301 😍🔥 e-mail: a@b.c", None),
]


def _pieces(text: str, seed: int) -> list[tuple[int, int]]:
    """Pieces of 1-3 characters that never hold whitespace, each character sometimes cut in
    two pieces that share its span (as an uncased WordPiece cuts Hangul)."""
    import random

    rng = random.Random(seed)
    spans: list[tuple[int, int]] = []
    i = 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        end = i + 1
        while end < len(text) and end - i < rng.randint(1, 3) and not text[end].isspace():
            end += 1
        spans.append((i, end))
        if end - i == 1 and rng.random() < 0.2:
            spans.append((i, end))
        i = end
    return spans


@pytest.mark.parametrize("seed", range(8))
def test_word_spans_agree_with_the_sdk_words(seed: int) -> None:
    """Words are the same everywhere: the viewer's and the SDK's ``by_words``."""
    from limelight_client import Explanation, Token

    for text, pair in AGREEING_TEXTS:
        infos = [TokenInfo("[CLS]", 0, 0, 0, True, 0)]
        infos += [TokenInfo("x", 0, s, e, False, 0) for s, e in _pieces(text, seed)]
        infos.append(TokenInfo("[SEP]", 0, 0, 0, True, 0))
        if pair is not None:
            infos += [TokenInfo("x", 0, s, e, False, 1) for s, e in _pieces(pair, seed + 1)]
            infos.append(TokenInfo("[SEP]", 0, 0, 0, True, 1))
        tokens = [Token(t.text, 1, t.start, t.end, t.special, t.segment) for t in infos]
        exp = Explanation(
            label="a",
            label_index=0,
            labels=["a"],
            probabilities={"a": 1.0},
            tokens=tokens,
            scores=[1.0] * len(tokens),
            method="m",
            target_label="a",
            target_index=0,
            text=text,
            text_pair=pair,
        )
        sdk = [(w.text, list(w.tokens), w.segment) for w in exp.words(punctuation_apart=True)]
        viewer = [(w["text"], w["tokens"], w["segment"]) for w in word_spans(infos, text, pair)]
        assert viewer == sdk, (text, pair)
    cjk = AGREEING_TEXTS[0][0]
    infos = [TokenInfo("x", 0, i, i + 1, False, 0) for i in range(len(cjk))]
    assert [w["text"] for w in word_spans(infos, cjk)] == list(cjk)


# --- the JSON routes ---------------------------------------------------------------------------


def test_model_and_explain(viewer_sidecar: RunningSidecar) -> None:
    url = base(viewer_sidecar)
    status, model, headers = call(f"{url}/viewer/api/model")
    assert status == 200 and headers["Cache-Control"] == "no-store"
    assert model["labels"] == ["negative", "neutral", "positive"]
    names = {m["name"]: m for m in model["methods"]}
    assert names["normxlogit"]["cost"] == "inline" and names["random"]["cost"] == "job"
    assert names["decoded_gradcam"]["unavailable_reason"]  # no masked-LM head here
    assert model["jobs"] and model["drift"] and not model["auth"]
    assert model["max_tokens"] > 0 and model["runtime"] == "torch"

    status, e, _ = call(f"{url}/viewer/api/explain", {"text": TEXT, "text_pair": "a film"})
    assert status == 200, e
    assert e["labels"] == model["labels"] and abs(sum(e["probabilities"]) - 1) < 1e-4
    assert e["target_index"] == e["label_index"] and e["method"] == "normxlogit"
    pieces = [t for t in e["tokens"] if not t["special"]]
    assert {t["segment"] for t in pieces} == {0, 1}
    assert len(e["class_scores"]) == 3 and all(
        len(r) == len(e["tokens"]) for r in e["class_scores"]
    )
    assert e["class_scores"][e["target_index"]] == pytest.approx([t["score"] for t in e["tokens"]])
    words = [w["text"] for w in e["words"]]
    assert words == ["a", "gorgeous", ",", "witty", ",", "seductive", "movie", "a", "film"]

    status, other, _ = call(f"{url}/viewer/api/explain", {"text": TEXT, "target": "neutral"})
    assert status == 200 and other["target_label"] == "neutral"

    for body, fragment in [
        ({"text": "  "}, "empty"),
        ({"text": TEXT, "method": "nope"}, "nope"),
        ({"text": TEXT, "target": "nope"}, "nope"),
        ({"text": 3}, "string"),
        ({"text": TEXT, "method": "random"}, "job method"),
    ]:
        status, error, _ = call(f"{url}/viewer/api/explain", body)
        assert status == 400 and fragment in error["error"], (body, error)
    # JSON only: a cross-site form post (text/plain) is refused before anything runs.
    status, error, _ = call(
        f"{url}/viewer/api/explain", json.dumps({"text": TEXT}).encode(), content_type="text/plain"
    )
    assert status == 415 and "application/json" in error["error"]


@pytest.fixture
def multi_label_sidecar(
    start_sidecar: Callable[..., RunningSidecar], tmp_path: Path, tokenizer_dir: Path
) -> RunningSidecar:
    """A tiny random 3-label BERT whose biases put two labels over their thresholds."""
    out = save_tiny_bert(
        tmp_path / "multi-label",
        tokenizer_dir,
        ["toxic", "insult", "spam"],
        seed=3,
        problem_type="multi_label_classification",
        biases=[4.0, 3.0, -4.0],
    )
    return start_sidecar(model_dir=out)


def test_multi_label_prediction(multi_label_sidecar: RunningSidecar) -> None:
    url = base(multi_label_sidecar)
    assert call(f"{url}/viewer/api/model")[1]["problem_type"] == "multi_label_classification"
    status, e, _ = call(f"{url}/viewer/api/explain", {"text": TEXT})
    assert status == 200, e
    assert e["multi_label"] is True and e["predicted_labels"] == ["toxic", "insult"]
    assert e["thresholds"] == [0.5, 0.5, 0.5] and sum(e["probabilities"]) > 1.0


def test_jobs_submit_watch_list_cancel(viewer_sidecar: RunningSidecar) -> None:
    url = base(viewer_sidecar)
    status, job, _ = call(
        f"{url}/viewer/api/jobs",
        {
            "method": "integrated_gradients",
            "text": TEXT,
            "params": {"steps": 8},
            "target": "positive",
        },
    )
    assert status == 201, job
    assert job["method"] == "integrated_gradients" and job["params"]["steps"] == 8
    # No tokens on this sidecar: a header nobody checks (a proxy's) names no owner.
    status, seen, _ = call(f"{url}/viewer/api/jobs/{job['id']}", token="added-by-a-proxy")
    assert status == 200 and seen["id"] == job["id"], seen
    done = wait_job(f"{url}/viewer/api/jobs/{job['id']}")
    assert done["state"] == "succeeded", done
    result = done["result"]
    assert result["target_label"] == "positive" and result["text"] == TEXT
    assert result["words"] and done["duration_s"] is not None
    # The job names the model it was submitted to, as the explanation it gave does.
    assert job["model_name"] and job["model_version"]
    assert (done["model_name"], done["model_version"]) == (
        result["model_name"],
        result["model_version"],
    )

    status, listing, _ = call(f"{url}/viewer/api/jobs?limit=10")
    assert status == 200 and job["id"] in [j["id"] for j in listing["jobs"]]
    assert all("result" not in j for j in listing["jobs"])
    status, listing, _ = call(f"{url}/viewer/api/jobs?state=queued")
    assert status == 200 and all(j["state"] == "queued" for j in listing["jobs"])

    for body, fragment in [
        ({"method": "integrated_gradients", "text": TEXT, "params": {"steps": -1}}, "steps"),
        ({"method": "normxlogit", "text": TEXT}, "inline"),
        ({"method": "random", "text": TEXT, "params": []}, "params"),
        ({"text": TEXT}, "method"),
    ]:
        status, error, _ = call(f"{url}/viewer/api/jobs", body)
        assert status == 400 and fragment in error["error"], (body, error)
    status, error, _ = call(f"{url}/viewer/api/jobs/no-such-job")
    assert status == 404
    status, error, _ = call(f"{url}/viewer/api/jobs?state=bogus")
    assert status == 400 and "bogus" in error["error"]

    status, cancelled, _ = call(f"{url}/viewer/api/jobs/{job['id']}/cancel", {})
    assert status == 200 and cancelled["state"] == "succeeded"  # finished jobs stay finished


def test_drift_report_and_history(viewer_sidecar: RunningSidecar) -> None:
    url = base(viewer_sidecar)
    status, report, _ = call(f"{url}/viewer/api/drift")
    assert status == 200 and report["reference_state"] == "building"
    for i in range(viewer_sidecar.settings.drift_bootstrap_n + 5):
        status, _, _ = call(f"{url}/viewer/api/explain", {"text": f"{TEXT} number {i}"})
        assert status == 200
    status, report, _ = call(f"{url}/viewer/api/drift?top_k=3")
    assert status == 200 and report["reference_state"] == "ready"
    assert {d["label"] for d in report["labels"]} == {"negative", "neutral", "positive"}
    assert report["alert_threshold"] == viewer_sidecar.settings.drift_alert_threshold
    assert report["sample_rate"] == viewer_sidecar.settings.drift_sample_rate == 1.0
    assert all(len(d["risers"]) <= 3 for d in report["labels"])
    history = report["history"]
    assert len(history) == 2 and history[-1]["state"] == "ready"
    assert set(history[-1]["labels"]) == {"negative", "neutral", "positive"}
    assert sum(history[-1]["counts"].values()) == report["window_count"] == 5
    # More requests within the page's 10 s add nothing: 720 of them replaced the whole history.
    for _ in range(30):
        assert call(f"{url}/viewer/api/drift")[0] == 200
    assert call(f"{url}/viewer/api/drift")[1]["history"] == history


def test_drift_is_sampled_in_the_background(
    start_sidecar: Callable[..., RunningSidecar], random_bert_dir: Path
) -> None:
    """The chart has a history even when no page asks: the sidecar samples on its own."""
    sidecar = start_sidecar(model_dir=random_bert_dir, viewer_drift_sample_s=0.05)
    url = base(sidecar)
    for i in range(sidecar.settings.drift_bootstrap_n + 3):
        assert call(f"{url}/viewer/api/explain", {"text": f"{TEXT} {i}"})[0] == 200
    while True:
        _, report, _ = call(f"{url}/viewer/api/drift")
        ready = [h for h in report["history"] if h["state"] == "ready"]
        if len(ready) >= 3:
            break
        time.sleep(0.05)
    times = [h["t"] for h in report["history"]]
    assert times == sorted(times) and len(report["history"]) <= 720
    assert ready[-1]["window_count"] == 3


def test_static_assets_and_headers(viewer_sidecar: RunningSidecar) -> None:
    url = base(viewer_sidecar)
    status, page, headers = call(f"{url}/viewer/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert 'src="static/viewer.js"' in page and "http://" not in page and "https://" not in page
    for name, kind in [("viewer.js", "text/javascript"), ("viewer.css", "text/css")]:
        status, body, headers = call(f"{url}/viewer/static/{name}")
        assert status == 200 and headers["Content-Type"].startswith(kind)
        assert "http://" not in body.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in body
    assert "innerHTML" not in call(f"{url}/viewer/static/viewer.js")[1]
    for path in [
        "/viewer/static/index.html",
        "/viewer/static/..%2f__init__.py",
        "/viewer/static/x",
    ]:
        assert call(url + path)[0] == 404, path
    status, _, headers = call(f"{url}/viewer")  # redirected to /viewer/
    assert status == 200 and headers["Content-Type"].startswith("text/html")


def test_bearer_tokens_and_job_owners(
    start_sidecar: Callable[..., RunningSidecar], random_bert_dir: Path, tmp_path: Path
) -> None:
    sidecar = two_token_sidecar(start_sidecar, tmp_path, model_dir=random_bert_dir)
    url = base(sidecar)
    assert call(f"{url}/viewer/")[0] == 200  # the page itself carries no data
    assert call(f"{url}/viewer/static/viewer.js")[0] == 200
    for path, body in [
        ("model", None),
        ("explain", {"text": TEXT}),
        ("jobs", None),
        ("jobs", {"method": "random", "text": TEXT}),
        ("drift", None),
    ]:
        status, error, headers = call(f"{url}/viewer/api/{path}", body)
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer", (path, error)
        assert call(f"{url}/viewer/api/{path}", body, token="wrong")[0] == 401
    status, model, _ = call(f"{url}/viewer/api/model", token="alice-token")
    assert status == 200 and model["auth"] is True

    status, job, _ = call(
        f"{url}/viewer/api/jobs", {"method": "random", "text": TEXT}, token="alice-token"
    )
    assert status == 201
    job_url = f"{url}/viewer/api/jobs/{job['id']}"
    assert wait_job(job_url, token="alice-token")["state"] == "succeeded"
    # Jobs belong to their submitter: another token neither sees nor cancels them ...
    assert call(job_url, token="bob-token")[0] == 404
    assert call(f"{job_url}/cancel", {}, token="bob-token")[0] == 404
    _, listing, _ = call(f"{url}/viewer/api/jobs", token="bob-token")
    assert job["id"] not in [j["id"] for j in listing["jobs"]]
    # ... and the owner is the same principal over gRPC.
    with Client(sidecar.target, token="alice-token", timeout=30) as client:
        assert client.job(job["id"]).refresh().state.name.lower() == "succeeded"
    with Client(sidecar.target, token="bob-token", timeout=30) as client:
        assert job["id"] not in [j.id for j in client.jobs()]


def test_without_jobs(start_sidecar: Callable[..., RunningSidecar], random_bert_dir: Path) -> None:
    sidecar = start_sidecar(model_dir=random_bert_dir, jobs="off")
    url = base(sidecar)
    assert call(f"{url}/viewer/api/model")[1]["jobs"] is False
    status, error, _ = call(f"{url}/viewer/api/jobs", {"method": "random", "text": TEXT})
    assert status == 501 and "disabled" in error["error"]
    assert call(f"{url}/viewer/api/explain", {"text": TEXT})[0] == 200


def test_client_certificate_owns_the_same_jobs_on_both_ports(
    start_sidecar: Callable[..., RunningSidecar], random_bert_dir: Path, tmp_path: Path
) -> None:
    """Under mutual TLS a job submitted from the viewer with a client certificate is the same
    principal's job over gRPC (the subject as gRPC prints it), and no one else's."""
    import ssl

    subjects = {"alice": "/C=NL/O=Lime, Inc./CN=alice", "bob": "/CN=bob"}
    make_pki(tmp_path, clients=subjects)
    sidecar = start_sidecar(
        model_dir=random_bert_dir,
        tls_cert=tmp_path / "server.pem",
        tls_key=tmp_path / "server.key",
        tls_client_ca=tmp_path / "ca.pem",
    )
    url = f"https://127.0.0.1:{sidecar.server.metrics_port}/viewer/api/jobs"

    def https(name: str, path: str = "", body: Any = None) -> tuple[int, Any]:
        context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        context.load_cert_chain(tmp_path / f"{name}.pem", tmp_path / f"{name}.key")
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url + path, data=data)
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=120, context=context) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    status, job = https("alice", body={"method": "random", "text": TEXT})
    assert status == 201, job
    assert https("bob", f"/{job['id']}")[0] == 404

    def grpc_client(name: str) -> Client:
        return Client(
            f"localhost:{sidecar.server.port}",
            tls=True,
            ca_cert=(tmp_path / "ca.pem").read_bytes(),
            client_cert=(tmp_path / f"{name}.pem").read_bytes(),
            client_key=(tmp_path / f"{name}.key").read_bytes(),
            timeout=30,
        )

    with grpc_client("alice") as client:
        assert job["id"] in [j.id for j in client.jobs()]
    with grpc_client("bob") as client:
        assert job["id"] not in [j.id for j in client.jobs()]


def test_flag_turns_the_viewer_off(
    start_sidecar: Callable[..., RunningSidecar], random_bert_dir: Path
) -> None:
    sidecar = start_sidecar(model_dir=random_bert_dir, viewer_enabled=False)
    url = base(sidecar)
    for path in ["/viewer/", "/viewer", "/viewer/static/viewer.js", "/viewer/api/model"]:
        assert call(url + path)[0] == 404, path
    assert call(f"{url}/v2")[0] == 200  # the other APIs stay


def test_serve_flag() -> None:
    """``limelight serve --no-viewer`` is ``LIMELIGHT_VIEWER_ENABLED=false``."""
    import argparse

    from limelight.cli.common import settings_from_args
    from limelight.cli.serve import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert settings_from_args(parser.parse_args(["serve"])).viewer_enabled is True
    assert settings_from_args(parser.parse_args(["serve", "--no-viewer"])).viewer_enabled is False


# --- in a real browser ---------------------------------------------------------------------------


def open_viewer(driver: Any, sidecar: RunningSidecar, fragment: str = "") -> None:
    driver.get(f"{base(sidecar)}/viewer/{fragment}")
    wait(driver, lambda d: d.execute_script("return document.body.dataset.ready === 'true'"))


def heatmap(driver: Any, selector: str = "#heatmap") -> list[tuple[str, float, tuple[int, ...]]]:
    """(text, score less the map's centre, background rgb) of every token span, as the browser
    computed them (the centre is 0, or the median when every score has one sign)."""
    rows = driver.execute_script(
        "const box = document.querySelector(arguments[0]);"
        "const centre = Number(box.dataset.centre);"
        "return [...box.querySelectorAll('.tok')].map(s => [s.textContent,"
        " Number(s.dataset.score) - centre, getComputedStyle(s).backgroundColor])",
        selector,
    )
    out = []
    for text, score, colour in rows:
        rgb = tuple(int(float(x)) for x in colour[colour.index("(") + 1 : -1].split(",")[:3])
        out.append((text, score, rgb))
    return out


def check_colour_order(spans: list[tuple[str, float, tuple[int, ...]]]) -> None:
    """Stronger scores are darker on their side of zero: orange above, blue below."""
    for sign in (1, -1):
        side = sorted((abs(s), 765 - sum(rgb), rgb) for _, s, rgb in spans if s * sign > 0)
        darkness = [d for _, d, _ in side]
        assert darkness == sorted(darkness), side
        for _, _, (r, _, b) in side:
            assert (r >= b) if sign > 0 else (b >= r)


def check_contrast(driver: Any, selector: str = "#heatmap") -> None:
    """WCAG AA for every token: 4.5:1, or 3:1 for large text (bold at 18.66 px or more)."""
    rows = driver.execute_script(
        "const rgb = c => c.slice(c.indexOf('(') + 1, -1).split(',').slice(0, 3).map(Number);"
        "return [...document.querySelectorAll(arguments[0] + ' .tok')].map(s => {"
        " const st = getComputedStyle(s);"
        " return [s.textContent, window.limelightViewer.contrast(rgb(st.color),"
        " rgb(st.backgroundColor)), Number(st.fontWeight), parseFloat(st.fontSize)]; })",
        selector,
    )
    assert rows
    for text, ratio, weight, size in rows:
        large = weight >= 700 and size >= 18.66
        assert ratio >= (3.0 if large else 4.5), (text, ratio, weight, size)


def explain_in_page(driver: Any, text: str, pair: str = "") -> None:
    from selenium.webdriver.common.by import By

    driver.find_element(By.CSS_SELECTOR, "nav a[data-view=explain]").click()
    box = driver.find_element(By.ID, "text")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, "pair").clear()
    if pair:
        driver.find_element(By.ID, "pair").send_keys(pair)
    driver.execute_script("document.getElementById('heatmap').replaceChildren()")
    driver.find_element(By.ID, "explain-button").click()
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#heatmap .tok"))


def no_console_errors(driver: Any) -> None:
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, "\n".join(e["message"] for e in errors)


@needs_browser
def test_browser_pages_explain_and_jobs(
    browser: Any, viewer_sidecar: RunningSidecar, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    driver = browser
    open_viewer(driver, viewer_sidecar)
    driver.save_screenshot(str(tmp_path / "viewer_start.png"))
    # Every section loads and shows its content.
    for view, probe in [
        ("model", "#methods-table tbody tr[data-method=normxlogit]"),
        ("jobs", "#jobs-table tbody tr"),
        ("drift", "#drift-chart svg"),
        ("compare", "#compare-form"),
    ]:
        driver.find_element(By.CSS_SELECTOR, f"nav a[data-view={view}]").click()

        def probed(d: Any, p: str = probe) -> Any:
            return d.find_elements(By.CSS_SELECTOR, p)

        wait(driver, probed)
        assert driver.find_element(By.ID, f"view-{view}").is_displayed()
        current = driver.find_element(By.CSS_SELECTOR, "nav a[aria-current=page]")
        assert current.get_attribute("data-view") == view
        driver.save_screenshot(str(tmp_path / f"viewer_{view}.png"))
    row = driver.find_element(By.CSS_SELECTOR, "tr[data-method=decoded_gradcam]")
    reason = row.get_attribute("textContent")
    assert "unavailable" in reason

    # Explain: prediction, heat-map tokens in text order, colours ordered by score.
    explain_in_page(driver, TEXT)
    spans = heatmap(driver)
    assert [t for t, _, _ in spans] == ["a", "gorgeous", ",", "witty", ",", "seductive", "movie"]
    check_colour_order(spans)
    check_contrast(driver)
    predicted = driver.find_element(By.CSS_SELECTOR, "#prediction .predicted").text
    assert "(predicted)" in predicted
    driver.save_screenshot(str(tmp_path / "viewer_explain.png"))

    # Keyboard: the first token takes focus and the arrows move along; its score is read out.
    first = driver.find_element(By.CSS_SELECTOR, "#heatmap .tok")
    driver.execute_script("arguments[0].focus()", first)
    first.send_keys(Keys.ARROW_RIGHT)
    focused = driver.switch_to.active_element
    assert focused.text == "gorgeous"
    assert "gorgeous" in driver.find_element(By.ID, "token-info").text
    assert "score" in driver.find_element(By.ID, "token-info").text

    # Words level, and another target class (the page switches without a round trip).
    driver.find_element(By.CSS_SELECTOR, "input[name=level][value=words]").click()
    words = heatmap(driver)
    assert [t for t, _, _ in words] == ["a", "gorgeous", ",", "witty", ",", "seductive", "movie"]
    check_colour_order(words)
    Select(driver.find_element(By.ID, "target")).select_by_visible_text("neutral")
    wait(driver, lambda d: "target=neutral" in d.current_url)
    assert "neutral" in driver.find_element(By.ID, "heatmap").get_attribute("aria-label")

    # The permalink reproduces the view in a fresh page.
    driver.find_element(By.ID, "permalink").click()
    link = driver.find_element(By.ID, "permalink-out").get_attribute("value")
    assert "level=words" in link and "target=neutral" in link
    driver.get("about:blank")
    driver.get(link)
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#heatmap .tok"))
    assert [t for t, _, _ in heatmap(driver)] == [t for t, _, _ in words]
    assert Select(driver.find_element(By.ID, "target")).first_selected_option.text == "neutral"

    # Exports are built in the page from the same units (what the download buttons save).
    exported_svg = driver.execute_script("return window.limelightViewer.heatmapSvg()")
    assert exported_svg.startswith("<svg") and exported_svg.count("<rect") == len(words) + 1
    exported_html = driver.execute_script("return window.limelightViewer.heatmapHtml()")
    assert exported_html.startswith("<!doctype html>") and "seductive" in exported_html
    # The buttons download them, the PNG drawn from the SVG on a canvas.
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    driver.execute_cdp_cmd(
        "Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)}
    )
    for button in ("export-svg", "export-html", "export-png"):
        driver.find_element(By.ID, button).click()
    names = {"limelight-heatmap.svg", "limelight-heatmap.html", "limelight-heatmap.png"}
    wait(driver, lambda d: {p.name for p in downloads.iterdir()} >= names)
    assert (downloads / "limelight-heatmap.png").read_bytes().startswith(b"\x89PNG")
    assert (downloads / "limelight-heatmap.svg").read_text().startswith("<svg")

    # Compare methods: submit a job from the page, watch it to completion, rank agreement.
    driver.find_element(By.CSS_SELECTOR, "input[name=level][value=tokens]").click()
    driver.find_element(By.CSS_SELECTOR, "nav a[data-view=compare]").click()
    Select(driver.find_element(By.ID, "job-method")).select_by_value("integrated_gradients")
    steps = driver.find_element(By.ID, "param-steps")
    steps.clear()
    steps.send_keys("8")
    driver.find_element(By.ID, "compare-submit").click()
    card = wait(
        driver,
        lambda d: d.find_elements(By.CSS_SELECTOR, ".run[data-state=succeeded] .agreement"),
    )[0]
    rho = float(card.get_attribute("data-spearman"))
    assert -1.0 <= rho <= 1.0
    assert len(driver.find_elements(By.CSS_SELECTOR, "#compare-runs .run")) == 2  # side by side
    job_spans = heatmap(driver, ".run[data-state=succeeded] .heatmap")
    assert [t for t, _, _ in job_spans] == [t for t, _, _ in spans]
    check_colour_order(job_spans)
    check_contrast(driver, ".run[data-state=succeeded] .heatmap")
    driver.save_screenshot(str(tmp_path / "viewer_compare_done.png"))
    # Its permalink shows the same comparison again in a fresh page.
    link = driver.current_url
    assert "#/compare?" in link and "jobs=" in link
    driver.get("about:blank")
    driver.get(link)
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".run[data-state=succeeded] .tok"))
    assert len(driver.find_elements(By.CSS_SELECTOR, "#compare-runs .run")) == 2

    # Jobs: the job is listed with its state; opening it shows its heat-map.
    driver.find_element(By.CSS_SELECTOR, "nav a[data-view=jobs]").click()
    row = wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#jobs-table tr[data-job-id]"))[0]
    assert "integrated_gradients" in row.text and "succeeded" in row.text
    row.find_element(By.XPATH, ".//button[text()='Open']").click()
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#job-detail .tok"))
    driver.save_screenshot(str(tmp_path / "viewer_jobs_open.png"))
    job_detail = driver.find_element(By.ID, "job-detail")
    assert "Model" in job_detail.text and "not the model served now" not in job_detail.text
    job_detail.find_element(By.XPATH, ".//button[text()='Download SVG']").click()
    wait(driver, lambda d: any(p.name.startswith("limelight-job-") for p in downloads.iterdir()))
    no_console_errors(driver)

    # Responsive: on a phone-sized window no section scrolls sideways.
    driver.set_window_size(390, 844)
    try:
        for view in ("explain", "compare", "jobs", "drift", "model"):
            driver.find_element(By.CSS_SELECTOR, f"nav a[data-view={view}]").click()

            def shown(d: Any, v: str = view) -> Any:
                return d.find_element(By.ID, f"view-{v}").is_displayed()

            wait(driver, shown)
            overflow = driver.execute_script(
                "return document.documentElement.scrollWidth - window.innerWidth"
            )
            driver.save_screenshot(str(tmp_path / f"viewer_narrow_{view}.png"))
            assert overflow <= 0, (view, overflow)
    finally:
        driver.set_window_size(1280, 1000)


@needs_browser
def test_browser_drift_page_says_the_sample_rate(
    browser: Any, start_sidecar: Callable[..., RunningSidecar], random_bert_dir: Path
) -> None:
    """A monitor that observes a share of the answers says so on the drift page (its counts
    are observed answers, not requests); one that observes all does not."""
    from selenium.webdriver.common.by import By

    for rate, shown in [(0.25, "observing 25 % of requests"), (1.0, None)]:
        sidecar = start_sidecar(model_dir=random_bert_dir, drift_sample_rate=rate)
        open_viewer(browser, sidecar)
        browser.find_element(By.CSS_SELECTOR, "nav a[data-view=drift]").click()
        summary = wait(browser, lambda d: d.find_element(By.ID, "drift-summary").text or None)
        assert re.match(r"reference building \(\d+ of \d+ explanations\) · ", summary), summary
        # Nothing in the window yet: no divergence of 0 that would read as healthy.
        assert "label-mix divergence – · " in summary and " → – bits" in summary
        cards = browser.find_elements(By.CSS_SELECTOR, "#drift-labels article p")
        assert cards and all("nothing to compare" in card.text for card in cards)
        if shown is None:
            assert "observing" not in summary
        else:
            assert shown in summary


@needs_browser
def test_browser_script_injection_is_inert(
    browser: Any, viewer_sidecar: RunningSidecar, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    open_viewer(driver, viewer_sidecar)
    hostile = f"{INJECTION} {INJECTION_SCRIPT} bad"
    explain_in_page(driver, hostile, pair="<b>bold</b>")
    heat = driver.find_element(By.ID, "heatmap")
    assert not heat.find_elements(By.TAG_NAME, "img")
    assert not heat.find_elements(By.TAG_NAME, "script")
    assert not heat.find_elements(By.TAG_NAME, "b")
    assert "<" in heat.text and "img" in heat.text and "script" in heat.text
    assert driver.execute_script("return window.__pwned === undefined")
    driver.find_element(By.CSS_SELECTOR, "input[name=level][value=words]").click()
    shown = [t for t, _, _ in heatmap(driver)]
    # Text, each punctuation character a word of its own (as BERT's pre-tokenizer has them).
    assert {"<", "img", "onerror", '"', "=", "window", "pwned", ">"} <= set(shown)
    assert driver.execute_script("return window.__pwned === undefined")
    exported = driver.execute_script("return window.limelightViewer.heatmapHtml()")
    (tmp_path / "injection_export.html").write_text(exported)
    assert "<img" not in exported and "<script" not in exported
    # As words the tags' "<" and ">" stand apart, escaped text as what sits between them.
    assert "&lt;" in exported and "&gt;" in exported and "pwned" in exported
    assert "<img" not in driver.execute_script("return window.limelightViewer.heatmapSvg()")
    driver.save_screenshot(str(tmp_path / "viewer_injection.png"))

    # The same text through a permalink, and as a job in the Jobs table.
    driver.find_element(By.ID, "permalink").click()
    link = driver.find_element(By.ID, "permalink-out").get_attribute("value")
    driver.get("about:blank")
    driver.get(link)
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#heatmap .tok"))
    assert not driver.find_elements(By.CSS_SELECTOR, "#heatmap img, #heatmap script")
    status, _, _ = call(
        f"{base(viewer_sidecar)}/viewer/api/jobs", {"method": "random", "text": hostile}
    )
    assert status == 201
    driver.find_element(By.CSS_SELECTOR, "nav a[data-view=jobs]").click()
    row = wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#jobs-table tr[data-job-id]"))[0]
    assert INJECTION in row.text and not row.find_elements(By.TAG_NAME, "img")
    assert driver.execute_script("return window.__pwned === undefined")
    no_console_errors(driver)


@needs_browser
def test_browser_rank_agreement_and_colour_scale(
    browser: Any, viewer_sidecar: RunningSidecar
) -> None:
    """The page's arithmetic: Spearman with ties, and the colour scale's centre."""
    driver = browser
    open_viewer(driver, viewer_sidecar)

    def js(expression: str) -> Any:
        return driver.execute_script(f"const v = window.limelightViewer; return {expression}")

    assert js("v.spearman([1, 2, 3, 4], [10, 20, 30, 40])") == pytest.approx(1.0)
    assert js("v.spearman([1, 2, 3, 4], [4, 3, 2, 1])") == pytest.approx(-1.0)
    # Ties take their average rank: ranks (1.5, 1.5, 3, 4) against (1, 2, 3, 4).
    assert js("v.spearman([5, 5, 6, 7], [1, 2, 3, 4])") == pytest.approx(0.9486833, abs=1e-6)
    assert js("v.spearman([1, 1, 1], [1, 2, 3])") is None  # constant: undefined
    units = "s => s.map(score => ({score}))"
    # Mixed signs: white is 0 and the scale is the largest magnitude.
    assert js(f"v.scaleOf(({units})([-0.5, 0.2, 1.0]))") == {"centre": 0, "scale": 1.0}
    # One sign and close in size (NormXLogit-like): white is the median.
    scale = js(f"v.scaleOf(({units})([1.0, 1.2, 1.1, 1.3, 1.25]))")
    assert scale["centre"] == pytest.approx(1.2) and scale["scale"] == pytest.approx(0.2)
    # One sign but far apart: still centred on 0.
    assert js(f"v.scaleOf(({units})([0.1, 2.0, 0.5]))")["centre"] == 0
    # The colour map: white at 0, orange above, blue below, the sign kept for grayscale.
    assert js("v.colour(0, 1)")["background"] == "rgb(247, 247, 247)"
    assert js("v.colour(1, 1)") == {
        "background": "rgb(179, 88, 6)",
        "foreground": "#ffffff",
        "sign": "pos",
        "bold": False,
    }
    # Every shade keeps AA contrast with its text colour (bold where 4.5:1 is out of reach).
    for step in range(-20, 21):
        cell = js(f"v.colour({step / 20}, 1)")
        background = [int(x) for x in cell["background"][4:-1].split(",")]
        text = [255, 255, 255] if cell["foreground"] == "#ffffff" else [27, 27, 27]
        ratio = js(f"v.contrast({text}, {background})")
        assert ratio >= (3.0 if cell["bold"] else 4.5), (step, cell, ratio)
    assert js("v.colour(-1, 1)")["background"] == "rgb(33, 102, 172)"
    assert js("v.colour(-0.2, 1)")["sign"] == "neg"
    # The legend: a ramp between the ends of the scale; when every token scores the same (a
    # one-word SLALOM importance), that sentence instead of a ramp from -0 to +0.
    legend = (
        "(d => (v.renderLegend(d, {centre}, {scale}), d.textContent))(document.createElement('p'))"
    )
    assert js(legend.format(centre=0, scale=0)) == "every token scores 0.000: none stands out"
    assert "-2.000 against" in js(legend.format(centre=0, scale=2))
    # Scores that are not numbers reach the page as null: they are not a score of 0.
    tokens = (
        "[0, 1, 2].map(i => ({special: false, start: 2 * i, end: 2 * i + 1, segment: 0, "
        "text: 'a'}))"
    )
    explanation = f"({{text: 'a a a', tokens: {tokens}, words: []}})"
    with_legend = (
        "(l => (d => (v.renderLegend(d, v.scaleOf(l).centre, v.scaleOf(l).scale, l), "
        "d.textContent))(document.createElement('p')))"
        f"(v.units({explanation}, SCORES, 'pieces'))"
    )
    assert js(with_legend.replace("SCORES", "[null, null, null]")) == (
        "no token has a finite score (nan or inf): this map shows nothing"
    )
    some = js(with_legend.replace("SCORES", "[0.5, null, -1]"))
    assert "1 of 3 tokens have no finite score" in some and "-1.000 against" in some
    assert "finite" not in js(with_legend.replace("SCORES", "[0.5, 0, -1]"))


@needs_browser
def test_browser_cuts_the_text_by_code_points(browser: Any, viewer_sidecar: RunningSidecar) -> None:
    """The server's offsets count code points; a JavaScript string counts UTF-16 units, two
    for an emoji. Every piece, word and gap the page shows is the text's own characters."""
    text = "I \U0001f4a9 love this \U0001f389 film, great \u00e9t\u00e9 \U0001f600!"
    status, explanation, _ = call(f"{base(viewer_sidecar)}/viewer/api/explain", {"text": text})
    assert status == 200
    open_viewer(browser, viewer_sidecar)
    scores = [1.0] * len(explanation["tokens"])
    for level in ("pieces", "words"):
        units = browser.execute_script(
            "return window.limelightViewer.units(arguments[0], arguments[1], arguments[2])",
            explanation,
            scores,
            level,
        )
        assert units, level
        for unit in units:
            assert unit["text"] == text[unit["start"] : unit["end"]], (level, unit)
        shown = "".join(unit["gap"] + unit["text"] for unit in units)
        assert shown == text[units[0]["start"] : units[-1]["end"]], level


@needs_browser
def test_browser_shows_the_pieces_of_one_character_once_with_their_sum(
    browser: Any, viewer_sidecar: RunningSidecar
) -> None:
    """An uncased BERT cuts each Hangul syllable into its letters, each with the syllable's
    span: the page showed "정정정말말말", each letter coloured apart."""
    spans = [(0, 1), (0, 1), (0, 1), (1, 2), (1, 2), (1, 2), (3, 5)]
    tokens = [{"text": "[CLS]", "start": 0, "end": 0, "special": True, "segment": 0}]
    tokens += [
        {"text": f"p{i}", "start": a, "end": b, "special": False, "segment": 0}
        for i, (a, b) in enumerate(spans)
    ]
    tokens.append({"text": "[SEP]", "start": 0, "end": 0, "special": True, "segment": 0})
    explanation = {"tokens": tokens, "words": [], "text": "정말 좋아", "text_pair": None}
    scores = [9.0, 0.25, 0.5, 1.0, -0.125, -0.25, -0.5, 2.0, 9.0]
    open_viewer(browser, viewer_sidecar)
    units = browser.execute_script(
        "return window.limelightViewer.units(arguments[0], arguments[1], 'pieces')",
        explanation,
        scores,
    )
    assert [(u["text"], u["score"], u["indices"]) for u in units] == [
        ("정", 1.75, [1, 2, 3]),
        ("말", -0.875, [4, 5, 6]),
        ("좋아", 2.0, [7]),
    ]


@needs_browser
def test_browser_drift_page_says_a_label_is_not_compared_until_it_has_enough(
    browser: Any, start_sidecar: Callable[..., RunningSidecar], random_bert_dir: Path
) -> None:
    """Below ``drift_min_count`` explanations a label's divergence is NaN (null in JSON): the
    card says why instead of failing to print it."""
    from selenium.webdriver.common.by import By

    sidecar = start_sidecar(
        model_dir=random_bert_dir, drift_bootstrap_n=20, drift_min_count=20, viewer_drift_sample_s=0
    )
    for i in range(30):  # 20 make the reference, 10 in the window: fewer than 20 of a label
        status, _, _ = call(f"{base(sidecar)}/viewer/api/explain", {"text": f"review {i} fine"})
        assert status == 200
    open_viewer(browser, sidecar)
    browser.find_element(By.CSS_SELECTOR, "nav a[data-view=drift]").click()
    summary = wait(browser, lambda d: d.find_element(By.ID, "drift-summary").text or None)
    assert summary.startswith("reference ready") and "label-mix divergence – · " in summary
    cards = [c.text for c in browser.find_elements(By.CSS_SELECTOR, "#drift-labels article p")]
    assert any("not compared yet" in c and "a label needs 20 in each" in c for c in cards), cards
    no_console_errors(browser)


@needs_browser
def test_browser_multi_label(browser: Any, multi_label_sidecar: RunningSidecar) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    open_viewer(driver, multi_label_sidecar)
    explain_in_page(driver, TEXT)
    predicted = [p.text for p in driver.find_elements(By.CSS_SELECTOR, "#prediction .predicted")]
    assert "toxic (predicted)" in predicted and "insult (predicted)" in predicted
    assert not any(p.startswith("spam") for p in predicted)
    assert "multi-label" in driver.find_element(By.ID, "prediction").text


@needs_browser
def test_browser_asks_for_the_bearer_token(
    browser: Any, start_sidecar: Callable[..., RunningSidecar], random_bert_dir: Path
) -> None:
    from selenium.webdriver.common.by import By

    sidecar = start_sidecar(model_dir=random_bert_dir, auth_token="viewer-secret")
    driver = browser
    driver.get(f"{base(sidecar)}/viewer/")
    form = wait(driver, lambda d: [f for f in d.find_elements(By.ID, "auth") if f.is_displayed()])
    assert "401" not in form[0].text and "bearer token" in form[0].text
    assert "bearer token" in driver.find_element(By.ID, "error").text
    driver.find_element(By.ID, "auth-token").send_keys("viewer-secret")
    form[0].find_element(By.TAG_NAME, "button").click()
    wait(driver, lambda d: "random-bert" in d.find_element(By.ID, "model-badge").text)
    assert not driver.find_element(By.ID, "auth").is_displayed()
    explain_in_page(driver, TEXT)
    assert heatmap(driver)
    # The token stays in the tab (session storage), never in the address.
    assert "viewer-secret" not in driver.current_url
    driver.find_element(By.ID, "permalink").click()
    assert "viewer-secret" not in driver.find_element(By.ID, "permalink-out").get_attribute("value")
    driver.execute_script("sessionStorage.clear()")


@needs_browser
def test_browser_says_how_much_of_a_truncated_text_was_explained(
    browser: Any, viewer_sidecar: RunningSidecar
) -> None:
    from selenium.webdriver.common.by import By

    long = "a gorgeous, witty film. " * 300
    status, e, _ = call(f"{base(viewer_sidecar)}/viewer/api/explain", {"text": long})
    assert status == 200 and e["truncated"]
    reached = e["explained_chars"]
    assert 0 < reached < e["text_chars"] == len(long)
    assert reached == max(w["end"] for w in e["words"])  # the last word the tokens reach
    short = call(f"{base(viewer_sidecar)}/viewer/api/explain", {"text": TEXT})[1]
    assert not short["truncated"] and short["explained_chars"] == short["text_chars"] == len(TEXT)

    driver = browser
    driver.get_log("browser")  # what earlier tests' pages logged is theirs
    open_viewer(driver, viewer_sidecar)
    driver.find_element(By.CSS_SELECTOR, "nav a[data-view=explain]").click()
    driver.execute_script("document.getElementById('text').value = arguments[0]", long)
    driver.execute_script("document.getElementById('heatmap').replaceChildren()")
    driver.find_element(By.ID, "explain-button").click()
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#heatmap .tok"))
    meta = driver.find_element(By.ID, "explain-meta").text
    said = f"(truncated: the first {reached:,} of {len(long):,} characters explained)"
    assert said in meta, meta
    no_console_errors(driver)

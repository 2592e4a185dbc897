"""Routes of the web viewer: its static assets and its JSON API (message conversion only)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import hashlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from importlib import resources
from typing import Any

import numpy as np
from aiohttp import web

from limelight.api.http_body import parse_json, read_body
from limelight.core.jobs import JobRecord, JobState
from limelight.core.service import ExplanationService
from limelight.core.types import (
    ExplainInput,
    Explanation,
    TargetSpec,
    TokenColumns,
    TokenInfo,
    scored_tokens,
)
from limelight.errors import InvalidArgument, Unavailable
from limelight.settings import Settings
from limelight_client._text import splits_at

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
RouteWrapper = Callable[[str, Handler, bool], Handler]

#: The files the page is made of, with their media types: nothing else is served.
ASSETS = {
    "viewer.js": "text/javascript",
    "viewer.css": "text/css",
}
#: Everything the page loads comes from this origin; inline scripts never run.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
MAX_LIST = 200
PREVIEW_CHARS = 160
DRIFT_HISTORY = 720
"""Drift samples kept for the chart (at the default 30 s interval: six hours)."""
PAGE_SAMPLE_GAP_S = 10.0
"""With the background sampler off, a page's request adds a sample at most this often (the
page asks every 10 s)."""


# --- JSON conversion ---------------------------------------------------------------------------


def jsonable(value: Any) -> Any:
    """Plain JSON values from parameters and details (numpy scalars and arrays, enums, NaN)."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def _floats(values: Any) -> list[float | None]:
    return [float(v) if math.isfinite(float(v)) else None for v in np.asarray(values).reshape(-1)]


def word_spans(
    tokens: Sequence[TokenInfo], text: str, text_pair: str | None = None
) -> list[dict[str, Any]]:
    """Words as BERT's basic pre-tokenizer defines them, as far as the pieces' offsets allow
    (a piece is never cut), the same as the SDK's ``by_words``: a piece joins the one before
    it when it starts where that one ended and neither character at the join is whitespace,
    punctuation or a CJK ideograph ("gorgeous" and ","; "这", "部"; an apostrophe between letters
    stays inside: "don't"; ``limelight_client._text.splits_at``, which the SDK's words use). A new
    word starts at a special token and a change of segment; pieces that share one
    character's span stay together."""
    words: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    prev = (0, 0)
    columns = TokenColumns.of(tokens)  # read in columns: no object per token
    for index, ((start, end), special, segment) in enumerate(
        zip(columns.offsets, columns.special, columns.segments, strict=True)
    ):
        if special or end <= start:
            current = None
            continue
        source = text_pair if segment == 1 and text_pair is not None else text
        joined = (
            current is not None
            and current["segment"] == segment
            and (
                # pieces of one character share its span (Hangul split into its letters)
                prev[0] <= start < prev[1]
                or (start == prev[1] and 0 < start < len(source) and not splits_at(source, start))
            )
        )
        if current is None or not joined:
            current = {"start": start, "end": end, "segment": segment, "tokens": []}
            words.append(current)
        current["end"] = max(current["end"], end)
        current["tokens"].append(index)
        prev = (start, end)
    for word in words:
        source = text_pair if word["segment"] == 1 and text_pair is not None else text
        word["text"] = source[word["start"] : word["end"]]
    return words


def explanation_json(e: Explanation, text: str, text_pair: str | None) -> dict[str, Any]:
    """An explanation for the page: tokens with their scores, words, and every class's scores
    when computed (so switching the target class needs no new request)."""
    a = e.attribution
    scores = _floats(a.scores)
    words = word_spans(e.tokens, text, text_pair)
    return {
        "label": e.label,
        "label_index": e.label_index,
        "labels": list(e.labels),
        "probabilities": _floats(e.probabilities),
        "method": a.method,
        "parameters": jsonable(a.parameters),
        "details": jsonable(a.details),
        "target_label": a.target_label,
        "target_index": a.target_index,
        "tokens": scored_tokens(e.tokens, scores),
        "words": words,
        "class_scores": (
            [_floats(row) for row in np.asarray(a.class_scores).T]
            if a.class_scores is not None
            else None
        ),
        "extra_scores": {name: _floats(v) for name, v in a.extra_scores.items()},
        "predicted_labels": list(e.predicted_labels),
        "multi_label": e.multi_label,
        "thresholds": _floats(e.thresholds),
        "windows": e.windows,
        "text": text,
        "text_pair": text_pair,
        "truncated": e.truncated,
        # how much of the text the tokens reach, in characters (what a truncated answer covers)
        "explained_chars": max((w["end"] for w in words if w["segment"] == 0), default=0),
        "text_chars": len(text),
        "model_name": e.model_name,
        "model_version": e.model_version,
        "timings_ms": {
            "total": e.timings.total_seconds * 1000.0,
            "queue": e.timings.queue_seconds * 1000.0,
            "forward": e.timings.forward_seconds * 1000.0,
            "attribute": e.timings.attribute_seconds * 1000.0,
            "batch_size": e.timings.batch_size,
        },
    }


def _target_json(target: TargetSpec | None) -> str | int | None:
    if target is None:
        return None
    return target.label if target.label is not None else target.index


def job_json(job: JobRecord, full: bool = True) -> dict[str, Any]:
    """A job; ``full`` adds its whole text and result (a listing carries a preview only)."""
    spec = job.spec
    duration = None
    if job.started_at is not None:
        end = job.finished_at if job.finished_at is not None else time.time()
        duration = max(0.0, end - job.started_at)
    body: dict[str, Any] = {
        "id": job.id,
        "state": job.state.value,
        "terminal": job.state.terminal,
        "method": spec.method,
        "params": jsonable(spec.params),
        "target": _target_json(spec.target),
        "progress": float(job.progress),
        "message": job.message,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "duration_s": duration,
        "attempts": job.attempts,
        "error": job.error,
        "model_name": spec.model_name,
        "model_version": spec.model_version,
        "no_worker": job.no_worker,
        "has_result": job.result is not None,
    }
    if full:
        body["text"] = spec.text
        body["text_pair"] = spec.text_pair
        body["result"] = (
            explanation_json(job.result, spec.text, spec.text_pair)
            if job.result is not None
            else None
        )
    else:
        preview = spec.text[:PREVIEW_CHARS]
        body["text"] = preview + ("…" if len(spec.text) > PREVIEW_CHARS else "")
    return body


def drift_json(report: Any) -> dict[str, Any]:
    """``limelight.drift.report.DriftReport`` as JSON (fields mirror ``GetDrift``)."""
    body: dict[str, Any] = jsonable(dataclasses.asdict(report))
    return body


# --- request parsing ---------------------------------------------------------------------------


def _string(body: Mapping[str, Any], key: str, required: bool = False) -> str | None:
    value = body.get(key)
    if value is None or (value == "" and not required):
        if required:
            raise InvalidArgument(f"'{key}' is required")
        return None
    if not isinstance(value, str):
        raise InvalidArgument(f"'{key}' must be a string")
    return value


def _target(body: Mapping[str, Any]) -> TargetSpec | None:
    label = _string(body, "target")
    index = body.get("target_index")
    if index is not None and (not isinstance(index, int) or isinstance(index, bool)):
        raise InvalidArgument("'target_index' must be an integer")
    if label is None and index is None:
        return None
    return TargetSpec(label=label, index=index if label is None else None)


def principal(request: web.Request, auth: bool = True) -> str:
    """Who is calling, for job ownership, as the gRPC API computes it for a bearer token (a
    digest of the token, never the token), else the client certificate's subject, else "".
    ``auth``: tokens are checked; without, a header nobody checked names no one (a proxy
    adding one would hide every job from the callers without it)."""
    scheme, _, token = (request.headers.get("Authorization") or "").partition(" ")
    if auth and scheme.lower() == "bearer" and token.strip():
        return "token:" + hashlib.sha256(token.strip().encode()).hexdigest()[:32]
    transport = request.transport
    cert = transport.get_extra_info("peercert") if transport is not None else None
    if cert and cert.get("subject"):
        return "x509:" + rfc2253(cert["subject"])
    return ""


#: Python's attribute names in ``getpeercert()`` as gRPC (BoringSSL, RFC 2253) prints them.
_RDN_NAMES = {
    "commonName": "CN",
    "countryName": "C",
    "localityName": "L",
    "stateOrProvinceName": "ST",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "streetAddress": "STREET",
    "domainComponent": "DC",
    "userId": "UID",
}


def rfc2253(subject: Sequence[Sequence[tuple[str, str]]]) -> str:
    """A certificate subject from ``ssl.getpeercert()`` as the RFC 2253 string gRPC reports as
    ``x509_subject`` (last RDN first), so a client certificate owns the same jobs on both
    ports."""

    def escape(value: str) -> str:
        out = "".join("\\" + c if c in ',+"\\<>;' else c for c in value)
        if out.startswith((" ", "#")):
            out = "\\" + out
        return out[:-1] + "\\ " if out.endswith(" ") else out

    return ",".join(
        "+".join(f"{_RDN_NAMES.get(k, k)}={escape(v)}" for k, v in rdn) for rdn in reversed(subject)
    )


async def _body(request: web.Request) -> Mapping[str, Any]:
    # JSON only: a cross-site form post (text/plain, no preflight) never reaches a handler.
    if request.content_type != "application/json":
        raise InvalidArgument("send the request body as application/json")
    body = parse_json(await read_body(request))
    if not isinstance(body, Mapping):
        raise InvalidArgument("the request body must be a JSON object")
    return body


def _json(body: Any, status: int = 200) -> web.Response:
    response = web.json_response(body, status=status)
    response.headers["Cache-Control"] = "no-store"
    return response


# --- the routes --------------------------------------------------------------------------------


class Viewer:
    """The viewer's routes; ``service`` returns None until the model is loaded."""

    def __init__(
        self,
        settings: Settings,
        service: Callable[[], ExplanationService | None],
        version: str = "",
        auth: bool = False,
    ) -> None:
        self.settings = settings
        self._service = service
        self._version = version
        self._auth = auth
        self._assets: dict[str, bytes] = {}
        self.history: deque[dict[str, Any]] = deque(maxlen=DRIFT_HISTORY)

    def ready_service(self) -> ExplanationService:
        service = self._service()
        if service is None:
            raise Unavailable("the model is still loading")
        return service

    def _asset(self, name: str) -> bytes:
        data = self._assets.get(name)
        if data is None:
            data = (resources.files(__package__) / "static" / name).read_bytes()
            self._assets[name] = data
        return data

    # --- static --------------------------------------------------------------------------------

    async def index(self, request: web.Request) -> web.StreamResponse:
        response = web.Response(body=self._asset("index.html"), content_type="text/html")
        response.headers.update(SECURITY_HEADERS)
        response.headers["Cache-Control"] = "no-cache"
        return response

    async def redirect(self, request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/viewer/")

    async def static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in ASSETS:
            raise web.HTTPNotFound(text="no such viewer asset")
        response = web.Response(body=self._asset(name), content_type=ASSETS[name])
        response.headers.update(SECURITY_HEADERS)
        response.headers["Cache-Control"] = "no-cache"
        return response

    # --- API -----------------------------------------------------------------------------------

    async def model(self, request: web.Request) -> web.StreamResponse:
        service = self.ready_service()
        info = service.model_info()
        body = jsonable(dataclasses.asdict(info))
        body.update(
            server_version=self._version,
            jobs=service.jobs is not None,
            drift=service.drift is not None,
            auth=self._auth,
            ready=service.ready,
            job_timeout_s=self.settings.job_timeout_s,
            job_timeout_max_s=self.settings.job_timeout_max_s,
            drift_alert_threshold=self.settings.drift_alert_threshold,
        )
        return _json(body)

    async def explain(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        text = _string(body, "text", required=True)
        assert text is not None
        pair = _string(body, "text_pair")
        request_input = ExplainInput(
            text=text,
            text_pair=pair,
            target=_target(body),
            all_classes=True,
            method=_string(body, "method") or "",
        )
        caller = principal(request, self._auth)  # its share of the inline backlog
        explanation = await self.ready_service().explain(request_input, caller)
        return _json(explanation_json(explanation, text, pair))

    async def submit(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        text = _string(body, "text", required=True)
        assert text is not None
        params = body.get("params")
        params = {} if params is None else params
        if not isinstance(params, Mapping):
            raise InvalidArgument("'params' must be an object")
        timeout = body.get("timeout_s", 0.0) or 0.0
        if not isinstance(timeout, int | float) or isinstance(timeout, bool):
            raise InvalidArgument("'timeout_s' must be a number")
        try:
            timeout = float(timeout)
        except OverflowError:  # an integer of hundreds of digits
            raise InvalidArgument("'timeout_s' is out of range") from None
        # Checked here too so that the message names this API's field, not the gRPC one.
        if not math.isfinite(timeout) or timeout < 0:
            raise InvalidArgument("'timeout_s' must be a finite number >= 0 (0: the default)")
        if timeout > self.settings.job_timeout_max_s:
            raise InvalidArgument(
                f"'timeout_s' {timeout:g} exceeds this server's maximum of "
                f"{self.settings.job_timeout_max_s:g} s"
            )
        job = await self.ready_service().submit_job(
            _string(body, "method", required=True) or "",
            text,
            _string(body, "text_pair"),
            _target(body),
            params,
            idempotency_key=_string(body, "idempotency_key") or "",
            timeout_s=timeout,
            owner=principal(request, self._auth),
        )
        return _json(job_json(job), status=201)

    async def jobs(self, request: web.Request) -> web.StreamResponse:
        try:
            limit = int(request.query.get("limit", "50"))
        except ValueError:
            raise InvalidArgument("'limit' must be an integer") from None
        states: list[JobState] = []
        for name in request.query.getall("state", []):
            try:
                states.append(JobState(name))
            except ValueError:
                raise InvalidArgument(f"unknown job state {name!r}") from None
        records, next_page = await self.ready_service().list_jobs(
            states or None,
            max(1, min(limit, MAX_LIST)),
            principal(request, self._auth),
            request.query.get("page_token", ""),
        )
        return _json(
            {"jobs": [job_json(j, full=False) for j in records], "next_page_token": next_page}
        )

    async def job(self, request: web.Request) -> web.StreamResponse:
        record = await self.ready_service().get_job(
            request.match_info["id"], principal(request, self._auth)
        )
        return _json(job_json(record))

    async def cancel(self, request: web.Request) -> web.StreamResponse:
        await _body(request)  # JSON only, like every POST here
        record = await self.ready_service().cancel_job(
            request.match_info["id"], principal(request, self._auth)
        )
        return _json(job_json(record))

    async def drift(self, request: web.Request) -> web.StreamResponse:
        try:
            top_k = int(request.query.get("top_k", "10"))
        except ValueError:
            raise InvalidArgument("'top_k' must be an integer") from None
        report = await self.ready_service().drift_report(max(1, min(top_k, 50)))
        if self._page_may_record(report):
            self._record(report)
        # NaN (a label not compared) is no JSON: the page reads null
        return _json({**drift_json(report), "history": jsonable(list(self.history))})

    # --- drift history -------------------------------------------------------------------------

    def _page_may_record(self, report: Any) -> bool:
        """A request adds a sample only where the sampler left a gap, or when the reference
        changed state: every request recording one let any client (or a few open tabs)
        replace the chart's six hours with seconds."""
        if not self.history:
            return True
        last = self.history[-1]
        gap = self.settings.viewer_drift_sample_s or PAGE_SAMPLE_GAP_S
        return bool(
            report.reference_state != last["state"] or report.generated_at - last["t"] >= gap
        )

    def _record(self, report: Any) -> None:
        """Append a sample of the per-label divergences to the chart's history."""
        self.history.append(
            {
                "t": report.generated_at,
                "state": report.reference_state,
                "window_count": report.window_count,
                "label_mix": report.label_mix_divergence,
                "labels": {d.label: d.divergence for d in report.labels},
                "counts": {d.label: d.window_count for d in report.labels},
            }
        )

    async def sample(self) -> None:
        """Take a drift sample now (no-op while loading or without drift monitoring)."""
        service = self._service()
        if service is not None and service.drift is not None:
            self._record(await service.drift_report(1))

    async def sampler(self, app: web.Application) -> AsyncIterator[None]:
        """aiohttp cleanup context: samples drift every ``viewer_drift_sample_s`` seconds, so
        the chart has a history even when nobody has the page open."""
        interval = self.settings.viewer_drift_sample_s

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval)
                with contextlib.suppress(Exception):
                    await self.sample()

        task = asyncio.ensure_future(loop()) if interval > 0 else None
        yield
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def add_to(self, app: web.Application, route: RouteWrapper) -> None:
        """Register the routes; ``route(rpc, handler, protected)`` adds auth, metrics, errors."""
        api = "/viewer/api"
        app.add_routes(
            [
                web.get("/viewer", self.redirect),
                web.get("/viewer/", self.index),
                web.get("/viewer/static/{name}", self.static),
                web.get(f"{api}/model", route("viewer.model", self.model, True)),
                web.post(f"{api}/explain", route("viewer.explain", self.explain, True)),
                web.get(f"{api}/jobs", route("viewer.jobs", self.jobs, True)),
                web.post(f"{api}/jobs", route("viewer.submit", self.submit, True)),
                web.get(f"{api}/jobs/{{id}}", route("viewer.job", self.job, True)),
                web.post(f"{api}/jobs/{{id}}/cancel", route("viewer.cancel", self.cancel, True)),
                web.get(f"{api}/drift", route("viewer.drift", self.drift, True)),
            ]
        )
        app.cleanup_ctx.append(self.sampler)

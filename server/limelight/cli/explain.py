"""`limelight explain`: classify a text and show its token attribution.

Inline methods answer at once; job methods (decoded_gradcam, lrp, slalom, ...) are submitted
as jobs, and ``--wait`` follows them with a progress bar. ``--local`` runs everything in this
process instead of calling a sidecar. ``--lines FILE`` explains every line of a file (or of
standard input) with an inline method and prints JSON Lines, in order.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import re
import sys
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from limelight.cli.common import (
    DEFAULT_TARGET,
    EXIT_USAGE,
    JobNotFinished,
    JobProgressBar,
    add_client_args,
    add_color_arg,
    add_model_args,
    add_wait_timeout_arg,
    add_words_arg,
    client_error_line,
    client_error_status,
    client_from_args,
    fail,
    follow_job,
    parse_params,
    settings_from_args,
    top_token_lines,
    use_color,
    whole,
)
from limelight.errors import InvalidArgument

#: ``--texts-per-call`` when it is not given.
TEXTS_PER_CALL = 16


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "explain",
        help="explain one text (terminal heat-map, --html, --json)",
        description="Classify TEXT and attribute the prediction to its tokens.",
    )
    p.add_argument("text", nargs="?", help="the text to classify; - reads it from standard input")
    p.add_argument(
        "--lines",
        metavar="FILE",
        help="explain every non-blank line of FILE (- for standard input) with an inline method "
        "and print one JSON object per line (JSON Lines, in input order, each with its line "
        "number); progress and a summary go to standard error; with --local, in this process",
    )
    p.add_argument(
        "--keep-going",
        action="store_true",
        help="with --lines: a line the server refuses or fails gets a JSON object with its "
        '"error" (code and message) in its place and the run goes on; the exit status is 1 '
        "if any line failed (default: the first failure ends the run)",
    )
    p.add_argument(
        "--texts-per-call",
        type=whole(1),  # no default here: given without --lines it is refused, not ignored
        help=f"with --lines: texts sent per ExplainBatch call (default {TEXTS_PER_CALL})",
    )
    p.add_argument(
        "--connections",
        type=whole(1),
        default=1,
        help="with --lines: connections to open (one or more per worker of a --workers sidecar)",
    )
    p.add_argument("--pair", dest="text_pair", help="second text for text-pair (NLI) models")
    p.add_argument(
        "--class",
        dest="target_class",
        action="append",  # to refuse a second one: argparse would keep the last without a word
        help="explain this class (label name or index) instead of the predicted one; once per "
        "call (--all-classes: every class's scores)",
    )
    p.add_argument("--all-classes", action="store_true", help="return every class's scores")
    p.add_argument("--method", default="", help="attribution method (default: the server's)")
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="method parameter (JSON value), repeatable, e.g. --param steps=64",
    )
    p.add_argument("--wait", action="store_true", help="for job methods: wait for the result")
    add_wait_timeout_arg(p)
    p.add_argument("--html", type=Path, help="also write a self-contained HTML heat-map here")
    p.add_argument("--json", action="store_true", help="print JSON instead of the heat-map")
    p.add_argument(
        "--top",
        type=whole(0),
        default=5,
        help="tokens to list for and against each label (default 5; 0: the heat-map alone)",
    )
    add_words_arg(p)
    add_color_arg(p)
    p.add_argument("--local", action="store_true", help="run in this process, no server")
    add_client_args(p, timeout_note="; with --lines, the longest wait for an answer")
    add_model_args(p)
    p.set_defaults(func=run)


def _target(value: str | None, labels: Callable[[], Sequence[str]] = tuple) -> str | int | None:
    """``--class``: a label's name, else (an integer) a class index. A name wins: ``--class 1``
    on a model whose labels are "0" to "4" (star ratings) is the label "1", not index 1.
    ``labels`` is asked only for a value that reads as an integer."""
    if value is None:
        return None
    if re.fullmatch(r"-?[0-9]+", value) and value not in labels():
        return int(value)
    return value


def _maps(explanation: Any, all_classes: bool, page: bool) -> list[str] | None:
    """The score arrays to draw (None: the target's, or on a multi-label model each explained
    label's): SLALOM's importance (how much a token matters at all) beside its values; with
    --all-classes every class's scores, multi-label models' too (every label, predicted or
    not)."""
    if explanation.method == "slalom":
        return ["value" if page else "scores", "importance"]
    if all_classes and explanation.class_scores is not None:
        return list(explanation.labels)
    return None


def _show(explanation: Any, args: argparse.Namespace) -> None:
    if args.words:
        explanation = explanation.by_words()
    # The result first: a file that cannot be written must not cost the answer (a job's).
    if args.json:
        print(json.dumps(explanation.to_dict(), indent=2))
    else:
        maps = _maps(explanation, args.all_classes, page=False)
        print(explanation.to_terminal(scores=maps or "scores", color=use_color(args.color)))
        for line in top_token_lines(explanation, args.top):
            print(line)
    if args.html is not None:
        explanation.to_html(args.html, scores=_maps(explanation, args.all_classes, page=True))
        if not args.json:
            print(f"HTML heat-map written to {args.html}")


def _follow(job: Any, quiet: bool, timeout: float | None) -> Any:
    """Watch a job with a progress bar until it ends, then return its explanation."""
    follow_job(job, quiet, timeout)
    return job.result(timeout=0)


def run(args: argparse.Namespace) -> int:
    from limelight_client.errors import LimelightError

    if (args.text is None) == (args.lines is None):
        return fail(args, "give either a TEXT or --lines FILE", 2)
    ignored = _ignored_flags(args)
    if ignored:
        return fail(args, ignored, EXIT_USAGE)
    classes = args.target_class or []
    if len(classes) > 1:
        return fail(
            args,
            f"--class given {len(classes)} times ({', '.join(classes)}): one call explains one "
            "label; use --all-classes for every class's scores, or one call per label",
            2,
        )
    args.target_class = classes[0] if classes else None
    if args.lines is not None:
        return _run_lines(args)
    if args.text == "-":  # texts longer than a shell argument, or piped from a file
        text = _read_as_text(sys.stdin).read().removeprefix("\ufeff")
        args.text = _utf8_or_replaced(text.removesuffix("\n").removesuffix("\r"), "the input")
    else:  # the shell passes bytes; Python reads those that are not UTF-8 as surrogates
        args.text = _utf8_or_replaced(args.text, "TEXT")
    if args.text_pair is not None:
        args.text_pair = _utf8_or_replaced(args.text_pair, "--pair")
    if args.html is not None and not args.html.parent.is_dir():
        # Found now, not after a job that ran for minutes.
        return fail(args, f"cannot write --html {args.html}: no folder {args.html.parent}", 1)
    try:
        explanation = _run_local(args) if args.local else _run_remote(args)
    except LimelightError as exc:  # a refused argument: 2, as --local refuses it
        line = client_error_line(exc, args.target, timeout=args.timeout)
        return fail(args, line, client_error_status(exc))
    except UnknownMethod as exc:  # --local refuses it as an invalid argument too
        return fail(args, str(exc), EXIT_USAGE)
    except JobNotFinished as exc:
        return fail(args, str(exc), 1)
    if explanation is not None:
        _show(explanation, args)
    return 0


def _ignored_flags(args: argparse.Namespace) -> str | None:
    """Why flags given together would be dropped without a word, or None."""
    if args.lines is None:
        alone = [
            flag
            for flag, given in (
                ("--keep-going", args.keep_going),
                ("--texts-per-call", args.texts_per_call is not None),
            )
            if given
        ]
        if alone:
            return f"{' and '.join(alone)} go{'es' if len(alone) == 1 else ''} with --lines"
    if not args.local:
        return None
    # --target and --token default to $LIMELIGHT_TARGET / $LIMELIGHT_TOKEN: a variable set
    # for other commands is no mistake, a flag that differs from it is.
    calls = [
        flag
        for flag, value, default in (
            ("--target", args.target, os.environ.get("LIMELIGHT_TARGET", DEFAULT_TARGET)),
            ("--token", args.token, os.environ.get("LIMELIGHT_TOKEN")),
            ("--texts-per-call", args.texts_per_call, None),
        )
        if value != default
    ]
    if calls:
        return f"--local explains in this process and calls no sidecar: drop {', '.join(calls)}"
    return None


def _refuse_flags_the_method_ignores(args: argparse.Namespace, method: str, cost: str) -> None:
    """Flags that would be dropped without a word for this method's cost class."""
    if cost == "inline" and args.param:
        raise InvalidArgument(
            f"--param: {method} runs inline and takes no parameters; parameters go to job "
            "methods (e.g. --method integrated_gradients --param steps=64)"
        )
    if cost != "inline" and args.all_classes:
        raise InvalidArgument(
            f"--all-classes: {method} runs as a job, which explains one class (--class); "
            "every class's scores come with inline methods"
        )


class UnknownMethod(Exception):
    """--method names a method the sidecar does not offer."""


def _run_remote(args: argparse.Namespace) -> Any:
    with client_from_args(args) as client:
        method = args.method
        cost = "inline"
        if method:
            try:
                cost = client.model().method(method).cost
            except KeyError as exc:  # the server's list, before anything is sent
                raise UnknownMethod(exc.args[0]) from None
        _refuse_flags_the_method_ignores(args, method or "the default method", cost)
        if cost == "inline":
            return client.explain(
                args.text,
                text_pair=args.text_pair,
                target=_target(args.target_class, lambda: client.model().labels),
                all_classes=args.all_classes,
                method=method or None,
            )
        job = client.submit(
            args.text,
            method,
            text_pair=args.text_pair,
            target=_target(args.target_class, lambda: client.model().labels),
            **parse_params(args.param),
        )
        if not args.wait and args.wait_timeout is None:  # --wait-timeout implies --wait
            if args.json:  # scripts read the job's id and state, as `limelight jobs show --json`
                print(json.dumps(job.info.to_dict(), indent=2))
            else:
                print(
                    f"submitted job {job.id} ({method}); follow it with: "
                    f"limelight jobs show {job.id}"
                )
            return None
        return _follow(job, quiet=args.json, timeout=args.wait_timeout)


def _run_local(args: argparse.Namespace) -> Any:
    """The same code path as the server, minus the network."""
    from limelight.api.convert import explanation_to_proto
    from limelight.app import build_application, load_served_model
    from limelight.cli.common import setup_logging
    from limelight.core.jobs import JobSpec
    from limelight.core.types import ExplainInput
    from limelight.metrics import Metrics
    from limelight_client.types import Explanation

    setup_logging("WARNING")
    settings = settings_from_args(
        args, jobs="off", drift_enabled=False, warmup=False, metrics_port=0
    )
    model = load_served_model(settings)
    spec = _target_spec(args, model.labels)
    app = build_application(settings, Metrics(), model)
    service = app.service
    method = service.methods.get(args.method) if args.method else service.default_method
    _refuse_flags_the_method_ignores(args, method.name, method.cost.value)
    if method.cost.value == "inline":

        async def once() -> Any:
            await service.start()
            try:
                return await service.explain(
                    ExplainInput(
                        text=args.text,
                        text_pair=args.text_pair,
                        target=spec,
                        all_classes=args.all_classes,
                        method=method.name,
                    )
                )
            finally:
                await service.close()

        result = asyncio.run(once())
    else:
        from limelight.jobs.runner import JobRunner

        service.encode(args.text, args.text_pair)
        job = JobSpec(
            method=method.name,
            text=args.text,
            text_pair=args.text_pair,
            target=spec,
            params=method.validate_params(parse_params(args.param)),
        )
        with JobProgressBar(method.name, quiet=args.json) as bar:
            result = JobRunner(model, service.methods, settings).run(job, report=bar.show)
    return Explanation.from_proto(
        explanation_to_proto(result), text=args.text, text_pair=args.text_pair
    )


def _target_spec(args: argparse.Namespace, labels: Sequence[str]) -> Any:
    """``--class`` as the core's ``TargetSpec`` (None: the predicted class)."""
    from limelight.core.types import TargetSpec

    target = _target(args.target_class, lambda: labels)
    if target is None:
        return None
    return TargetSpec(label=target) if isinstance(target, str) else TargetSpec(index=target)


class _LineRefused(Exception):
    """``--lines`` without ``--keep-going``: the sidecar refused a line (its error in place)."""

    def __init__(self, error: Any) -> None:
        super().__init__(error)
        self.error = error


class _JobMethod(Exception):
    """``--lines`` was given a method that runs as a job."""


def _explain_lines_local(
    args: argparse.Namespace, texts: Iterator[str], emit: Callable[[Any], None]
) -> None:
    """``--lines --local``: the texts through the core service's ordered stream in this
    process (the server's code path, minus the network), each explanation to ``emit``."""
    from limelight.api.convert import explanation_to_proto
    from limelight.api.errors import client_status
    from limelight.app import build_application, load_served_model
    from limelight.cli.common import setup_logging
    from limelight.core.types import ExplainInput, Failed
    from limelight.metrics import Metrics
    from limelight_client.errors import from_status
    from limelight_client.types import Explanation

    setup_logging("WARNING")
    settings = settings_from_args(
        args, jobs="off", drift_enabled=False, warmup=False, metrics_port=0
    )
    model = load_served_model(settings)
    spec = _target_spec(args, model.labels)
    service = build_application(settings, Metrics(), model).service
    method = service.methods.get(args.method) if args.method else service.default_method
    if method.cost.value != "inline":
        raise _JobMethod(method.name)
    sent: deque[str] = deque()  # the texts in flight, in order, to pair with their answers

    async def inputs() -> AsyncIterator[ExplainInput | Failed]:
        for text in texts:
            sent.append(text)
            yield ExplainInput(
                text=text,
                text_pair=None,
                target=spec,
                all_classes=args.all_classes,
                method=method.name,
                continue_on_error=args.keep_going,
            )

    async def run() -> None:
        await service.start()
        try:
            async for result in service.explain_many(inputs()):
                text = sent.popleft()
                if isinstance(result, Failed):  # what a server would have answered with
                    emit(from_status(*client_status(result.error)))
                else:
                    emit(Explanation.from_proto(explanation_to_proto(result), text=text))
        finally:
            await service.close()

    asyncio.run(run())


def _read_as_text(stream: TextIO) -> TextIO:
    """``stream`` (standard input) read as ``--lines`` and ``explain -`` read files: lines end
    at line feeds only, and bytes that are not UTF-8 come through as surrogates (see
    ``_utf8_or_replaced``) instead of ending the run with a traceback."""
    if isinstance(stream, io.TextIOWrapper):
        with contextlib.suppress(ValueError, io.UnsupportedOperation):  # already read from
            stream.reconfigure(encoding="utf-8", errors="surrogateescape", newline="\n")
    return stream


def _utf8_or_replaced(text: str, where: str) -> str:
    """``text`` as it came, or, where it held bytes read as surrogates, those bytes decoded
    as UTF-8: under the POSIX locale (without UTF-8 mode) every byte over 127 of a shell
    argument comes as one, "电影" too, and reads back whole. Bytes that are not UTF-8 become
    U+FFFD, with a warning that says where (and only then: the text may be intact)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        pass
    else:
        return text
    decoded = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if decoded.count("\ufffd") > text.count("\ufffd"):
        print(
            f"limelight explain: warning: {where} is not valid UTF-8; its undecodable bytes "
            "are read as U+FFFD",
            file=sys.stderr,
        )
    return decoded


def _numbered_lines(stream: TextIO) -> Iterator[tuple[int, str]]:
    """(line number, text) of every non-blank line, read lazily. Lines end at a line feed
    (a carriage return before it is dropped; one alone stays in the text, as whitespace);
    a byte-order mark before the first line is not part of it."""
    for number, line in enumerate(stream, start=1):
        text = line.rstrip("\r\n")
        if number == 1:
            text = text.removeprefix("\ufeff")
        if text.strip():
            yield number, _utf8_or_replaced(text, f"line {number}")


def _run_lines(args: argparse.Namespace) -> int:
    """``--lines``: JSON Lines out, one per non-blank input line, through ``explain_many`` in
    ``ExplainBatch`` calls (or, ``--local``, the core service in this process); an error names
    the input line it came from."""
    from limelight.errors import LimelightError as ServerError
    from limelight.progress import progress_bar
    from limelight_client.errors import LimelightError
    from limelight_client.types import Explanation

    refused = [
        flag
        for flag, given in (
            ("--html", args.html),
            ("--pair", args.text_pair),
            ("--param", args.param),
        )
        if given
    ]
    if refused:
        return fail(args, f"--lines does not go with {', '.join(refused)}", 2)
    total = None
    if args.lines == "-":
        source = _read_as_text(sys.stdin)
    else:
        try:
            source = open(  # noqa: SIM115  (closed by the with below)
                args.lines, encoding="utf-8", errors="surrogateescape", newline="\n"
            )
            total = sum(1 for line in source if line.strip())  # for the progress bar
            source.seek(0)
        except OSError as exc:
            return fail(args, f"cannot read {args.lines}: {exc}", 2)
    numbers: list[int] = []  # the line number of every text sent, in order

    def texts() -> Iterator[str]:
        for number, text in _numbered_lines(source):
            numbers.append(number)
            yield text

    labels: Counter[str] = Counter()
    failures: Counter[str] = Counter()  # --keep-going: the lines answered by an error, by code
    done = 0
    start = time.perf_counter()
    try:
        with source, progress_bar(total=total, desc="explain", unit="text") as bar:

            def emit(outcome: Explanation | LimelightError) -> None:
                nonlocal done
                if isinstance(outcome, LimelightError):
                    code = outcome.code.name if outcome.code is not None else "UNKNOWN"
                    row = {
                        "line": numbers[done],
                        "error": {"code": code, "message": outcome.message},
                    }
                    failures[code] += 1
                else:
                    shown = outcome.by_words() if args.words else outcome
                    row = {"line": numbers[done], **shown.to_dict()}
                    if outcome.multi_label:  # every label at or over its threshold
                        labels.update(outcome.predicted_labels or ["(none)"])
                    else:
                        labels[outcome.label] += 1
                # Piped in, lines may come as they are written: pass each answer on at once.
                print(json.dumps(row), flush=source is sys.stdin)
                done += 1
                bar.update()

            if args.local:
                _explain_lines_local(args, texts(), emit)
            else:
                with client_from_args(args, connections=args.connections) as client:
                    if args.method and client.model().method(args.method).cost != "inline":
                        raise _JobMethod(args.method)
                    # Errors in their places even without --keep-going: the lines before a
                    # refused one, in its call too, are printed before the run stops.
                    for explanation in client.explain_many(
                        texts(),
                        target=_target(args.target_class, lambda: client.model().labels),
                        all_classes=args.all_classes,
                        method=args.method or None,
                        texts_per_call=args.texts_per_call or TEXTS_PER_CALL,
                        return_exceptions=True,
                    ):
                        if isinstance(explanation, LimelightError) and not args.keep_going:
                            raise _LineRefused(explanation)
                        emit(explanation)
    except _JobMethod as exc:
        return fail(
            args,
            f"--lines explains with inline methods; {exc.args[0]} runs as a job "
            f"(one text: limelight explain TEXT --method {exc.args[0]} --wait)",
            2,
        )
    except KeyError as exc:  # --method the server does not offer
        return fail(args, exc.args[0], 1)
    except (_LineRefused, ServerError) as exc:  # the line in order is the one refused
        message = exc.message if isinstance(exc, ServerError) else exc.error.message
        if done < len(numbers):
            message = f"line {numbers[done]}: {message}"
        return fail(args, f"{message} ({done} line(s) explained before it)", 1)
    except LimelightError as exc:  # the sidecar, not a line (unreachable, shutting down, ...)
        message = client_error_line(exc, args.target, timeout=args.timeout)
        return fail(args, f"{message} ({done} line(s) explained before it)", 1)
    seconds = time.perf_counter() - start
    counts = ", ".join(f"{label} {n:,}" for label, n in labels.most_common())
    explained = done - failures.total()
    print(
        f"explained {explained:,} line(s) in {seconds:.1f} s ({done / max(seconds, 1e-9):,.0f}/s)"
        + (f": {counts}" if counts else ""),
        file=sys.stderr,
    )
    if failures:
        codes = ", ".join(f"{code} {n:,}" for code, n in failures.most_common())
        return fail(args, f'{failures.total():,} line(s) failed ({codes}); see their "error" lines')
    return 0

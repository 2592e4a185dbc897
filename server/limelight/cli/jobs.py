"""`limelight jobs list|show|cancel|watch`: inspect and manage jobs of a running sidecar."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
from typing import Any

from limelight.cli.common import (
    JobNotFinished,
    add_client_args,
    add_color_arg,
    add_wait_timeout_arg,
    add_words_arg,
    client_error_line,
    client_error_status,
    client_from_args,
    fail,
    follow_job,
    top_token_lines,
    use_color,
    whole,
)

_STATES = ["queued", "running", "succeeded", "failed", "cancelled"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "jobs",
        help="list, show, watch or cancel explanation jobs",
        description="Inspect and manage the explanation jobs of a running sidecar over gRPC.",
    )
    sub = p.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)

    ls = sub.add_parser("list", help="recent jobs, newest first")
    add_client_args(ls)
    ls.add_argument(
        "--state", action="append", choices=_STATES, help="only jobs in this state (repeatable)"
    )
    count = ls.add_mutually_exclusive_group()
    count.add_argument(
        "--limit",
        type=whole(1, 1000),
        default=50,
        help="at most this many jobs (default 50; 1000 at most)",
    )
    count.add_argument(
        "--all", action="store_true", help="every job the sidecar holds, read a page at a time"
    )
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(func=run_list)

    show = sub.add_parser("show", help="one job, with its explanation once it succeeded")
    add_client_args(show)
    show.add_argument("id", help="job id")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.add_argument(
        "--top",
        type=whole(0),
        default=5,
        help="tokens to list for and against each label (default 5; 0: the heat-map alone)",
    )
    add_words_arg(show)
    add_color_arg(show)
    show.set_defaults(func=run_show)

    watch = sub.add_parser("watch", help="follow a job's progress until it ends")
    add_client_args(watch)
    watch.add_argument("id", help="job id")
    watch.add_argument(
        "--top",
        type=whole(0),
        default=5,
        help="tokens to list for and against each label (default 5; 0: the heat-map alone)",
    )
    add_words_arg(watch)
    add_color_arg(watch)
    add_wait_timeout_arg(watch)
    watch.set_defaults(func=run_watch)

    cancel = sub.add_parser("cancel", help="cancel a queued or running job")
    add_client_args(cancel)
    cancel.add_argument("id", help="job id")
    cancel.set_defaults(func=run_cancel)


def _when(t: dt.datetime | None) -> str:
    return t.astimezone().strftime("%Y-%m-%d %H:%M:%S") if t is not None else "-"


def _duration(info: Any) -> str:
    if info.started_at is None:
        return "-"
    end = info.finished_at or dt.datetime.now(dt.UTC)
    return f"{(end - info.started_at).total_seconds():.1f}s"


def format_table(rows: list[list[str]], header: list[str], encoding: str | None = None) -> str:
    """Columns padded to their widest cell; the last column is left ragged. Cells come from
    the server (a job's method, message, ...): nothing in them may act on the terminal, and a
    character ``encoding`` (standard output's by default) cannot write is shown as ``?``
    before the columns are measured."""
    from limelight_client.render import columns, displayable, output_encoding, pad, terminal_safe

    encoding = encoding or output_encoding()
    rows = [[displayable(terminal_safe(cell), encoding) for cell in row] for row in rows]
    widths = [max(columns(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [pad(c, w) for c, w in zip(row[:-1], widths[:-1], strict=True)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines)


def _clip(text: str, width: int, encoding: str = "utf-8") -> str:
    """``text`` on one table cell: cut to ``width`` characters, an ellipsis saying so (``…``,
    or ``...`` where ``encoding`` cannot write that)."""
    from limelight_client.render import encodable

    text = " ".join(text.split())
    ellipsis = "…" if encodable("…", encoding) else "..."
    return text if len(text) <= width else text[: width - len(ellipsis)] + ellipsis


def _model(info: Any, version_chars: int | None = 8) -> str:
    """The model a job was submitted to, ``name@version`` (``-`` for jobs journaled before
    jobs recorded it); a short hash in a table, as git abbreviates commits."""
    name = getattr(info, "model_name", "") or ""
    version = getattr(info, "model_version", "") or ""
    if not name and not version:
        return "-"
    return f"{name or '?'}@{version[:version_chars]}" if version else name


def jobs_table(infos: list[Any], encoding: str | None = None) -> str:
    """One row per job. MODEL tells apart jobs submitted to different models (a Redis queue
    shared across a rollout, a journal that outlived its model): another model's job fails.
    ``encoding``: that of where the table goes (default: standard output's)."""
    from limelight_client.render import output_encoding

    encoding = encoding or output_encoding()
    rows = [
        [
            info.id,
            info.state.name.lower(),
            _model(info),
            info.method,
            f"{100 * info.progress:.0f}%",
            str(info.attempts),
            _when(info.created_at),
            _duration(info),
            _clip(info.error or info.message, 64, encoding),
        ]
        for info in infos
    ]
    header = ["ID", "STATE", "MODEL", "METHOD", "PROGRESS", "ATTEMPTS", "CREATED", "RAN", "MESSAGE"]
    return format_table(rows, header, encoding)


def describe(
    info: Any, top: int = 5, color: bool | None = None, encoding: str | None = None
) -> str:
    """A human-readable page about one job, for a stream in ``encoding`` (default: standard
    output's): the heat-map's drawing characters and the job's text as that can write them."""
    lines = [
        f"job        {info.id}",
        f"state      {info.state.name.lower()}",
        f"method     {info.method}",
        f"model      {_model(info, None)}",
        f"parameters {json.dumps(info.parameters, sort_keys=True)}",
        f"progress   {100 * info.progress:.0f}%  {info.message}",
        f"attempts   {info.attempts}",
        f"created    {_when(info.created_at)}",
        f"started    {_when(info.started_at)}",
        f"finished   {_when(info.finished_at)}",
    ]
    if info.idempotency_key:
        lines.append(f"key        {info.idempotency_key}")
    if info.error:
        lines.append(f"error      {info.error}")
    # Anyone who may submit a job chooses its key and parameters; the server words its
    # message and error: none of it may drive the terminal of whoever reads the job.
    from limelight_client.render import displayable, output_encoding, terminal_safe, to_terminal

    encoding = encoding or output_encoding()
    lines = [displayable(terminal_safe(line), encoding) for line in lines]
    result = info.result
    if result is not None:
        lines.append("")
        lines.append(to_terminal(result, color=color, encoding=encoding))
        lines.extend(displayable(line, encoding) for line in top_token_lines(result, top))
    return "\n".join(lines)


def _call(args: argparse.Namespace, action: Any) -> int:
    from limelight_client.errors import LimelightError

    try:
        with client_from_args(args) as client:
            return int(action(client) or 0)
    except LimelightError as exc:  # a refused argument: 2; anything else: 1
        line = client_error_line(exc, args.target, timeout=args.timeout)
        return fail(args, line, client_error_status(exc))
    except JobNotFinished as exc:
        return fail(args, str(exc), 1)


def run_list(args: argparse.Namespace) -> int:
    def action(client: Any) -> int:
        states = args.state or None
        if args.all:
            infos = list(client.iter_jobs(states=states, page_size=1000))
        else:
            infos = client.jobs(states=states, limit=args.limit)
        if args.json:
            print(json.dumps([i.to_dict() for i in infos], indent=2))
        elif infos:
            print(jobs_table(infos))
        else:
            print("no jobs")
        return 0

    return _call(args, action)


def _in_words(info: Any, words: bool) -> Any:
    """The job with its result's word pieces merged (``--words``)."""
    if not words or info.result is None:
        return info
    return dataclasses.replace(info, result=info.result.by_words())


def run_show(args: argparse.Namespace) -> int:
    def action(client: Any) -> int:
        info = _in_words(client.job(args.id).info, args.words)
        if args.json:
            print(json.dumps(info.to_dict(), indent=2))
        else:
            print(describe(info, args.top, use_color(args.color)))
        return 0

    return _call(args, action)


def run_watch(args: argparse.Namespace) -> int:
    def action(client: Any) -> int:
        job = client.job(args.id)
        follow_job(job, timeout=args.wait_timeout)
        info = _in_words(job.refresh(), args.words)
        print(describe(info, args.top, use_color(args.color)))
        return 0 if info.state.name == "SUCCEEDED" else 1

    return _call(args, action)


def run_cancel(args: argparse.Namespace) -> int:
    def action(client: Any) -> int:
        info = client.job(args.id).cancel()
        state = info.state.name.lower()
        if state == "running":
            print(f"job {info.id}: cancellation requested; it stops at its next checkpoint")
        elif state == "cancelled":
            print(f"job {info.id}: cancelled")
        else:  # it ended before the cancel came: nothing was cancelled
            print(f"job {info.id}: already {state}; nothing to cancel")
        return 0

    return _call(args, action)

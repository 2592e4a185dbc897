"""Helpers shared by the CLI commands: settings from flags, logging, client options."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from limelight.errors import InvalidArgument
from limelight.settings import Settings, unknown_variables

DEFAULT_TARGET = "localhost:50051"


def whole(minimum: int = 0, maximum: int | None = None) -> Callable[[str], int]:
    """argparse type: a whole number from ``minimum`` to ``maximum``. Out of range, argparse
    names the flag and exits with status 2 before anything loads (a model, hours of labels)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects a whole number, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"at least {minimum}" if maximum is None else f"{minimum} to {maximum}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def real(
    minimum: float = 0.0, maximum: float | None = None, *, above: bool = False
) -> Callable[[str], float]:
    """argparse type: a finite number from ``minimum`` (excluded when ``above``) to
    ``maximum``; out of range, argparse names the flag and exits with status 2."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects a number, got {text!r}") from None
        low_ok = value > minimum if above else value >= minimum
        if not math.isfinite(value) or not low_ok or (maximum is not None and value > maximum):
            low = f"above {minimum:g}" if above else f"at least {minimum:g}"
            bound = low if maximum is None else f"{low} and at most {maximum:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


def one_of(*choices: str) -> Callable[[str], str]:
    """argparse type: one of ``choices`` (for the items of a :func:`listed` flag; a single
    value takes argparse's own ``choices``)."""

    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"unknown {text!r}; use {', '.join(choices)}")
        return text

    return parse


def listed(item: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    """argparse type: a comma-separated list of ``item`` values (at least one), each checked
    by ``item``; duplicates dropped, order kept."""

    def parse(text: str) -> tuple[Any, ...]:
        values = tuple(
            dict.fromkeys(item(part.strip()) for part in text.split(",") if part.strip())
        )
        if not values:
            raise argparse.ArgumentTypeError("expects a comma-separated list, got nothing")
        return values

    return parse


def unparsable(cause: object | None) -> str:
    """Why a setting's value was refused before it was even read, the same for its flag and
    its LIMELIGHT_* variable: ``cause`` is the JSON decoder's word, where there is one."""
    because = f" ({cause})" if cause is not None else ""
    return f"cannot be parsed{because}; lists and mappings are written as JSON"


def json_value(text: str) -> Any:
    """argparse type: a JSON value (``--label-thresholds '{"toxic": 0.3}'``); one that does not
    decode is refused in the words its environment variable gets."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(unparsable(exc)) from None


#: Exit status of a command that failed because of its arguments or settings.
EXIT_USAGE = 2
#: Exit status of any other failure.
EXIT_FAILURE = 1


def command_name(args: argparse.Namespace) -> str:
    """The command as typed: ``explain``, ``jobs show``, ``drift-reference build``."""
    nested = (getattr(args, name, None) for name in ("action", "jobs_command"))
    return " ".join(str(x) for x in (getattr(args, "command", None), *nested) if x)


def fail(args: argparse.Namespace, message: str, status: int = EXIT_FAILURE) -> int:
    """Say why the command stops, on one line in the form every error of the CLI takes
    (``limelight <command>: error: <message>``, as argparse's own), and return ``status``."""
    print(f"limelight {command_name(args)}: error: {message}", file=sys.stderr)
    return status


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        dest="model_dir",
        type=Path,
        help="local Hugging Face classifier directory, or a Hugging Face model id (org/name"
        "[@revision]) already in the local Hugging Face cache; never downloaded (default: the "
        "demo model)",
    )
    parser.add_argument(
        "--demo",
        dest="demo_model",
        choices=["minilm", "bert-tiny", "bert-tiny-multilabel"],
        help="which demo model to use when --model is not given (default: minilm)",
    )
    parser.add_argument("--cache-dir", type=Path, help="cache for built demo models")
    parser.add_argument("--device", help="cpu, cuda, cuda:N or auto")
    parser.add_argument(
        "--torch-threads", type=int, help="intra-op threads for torch (0: torch's default)"
    )


def settings_from_args(args: argparse.Namespace, **overrides: Any) -> Settings:
    """Settings from LIMELIGHT_* env, overridden by every flag that was given."""
    values = {
        field: getattr(args, field)
        for field in Settings.model_fields
        if getattr(args, field, None) is not None
    }
    values.update(overrides)
    for line in unknown_variables(os.environ):  # before a settings error ends the command
        print(f"warning: {line}", file=sys.stderr)
    return Settings(**values)


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
    )


def add_words_arg(parser: argparse.ArgumentParser) -> None:
    """``--words`` of commands that show an explanation; its help names the outputs the
    command has."""
    flags = {"--json", "--html"} & set(parser._option_string_actions)
    outputs = ", ".join(["the heat-map", "the lists", *sorted(flags, reverse=True)])
    parser.add_argument(
        "--words",
        action="store_true",
        help="show whole words: each word's pieces merged into one token, their scores summed "
        f"({outputs})",
    )


def add_color_arg(parser: argparse.ArgumentParser) -> None:
    """``--color`` of commands that print a heat-map."""
    parser.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="colour the heat-map: auto (default) when standard output is a terminal, unless "
        "NO_COLOR is set or TERM is dumb (FORCE_COLOR forces it); never prints each score "
        "after its token",
    )
    # The spelling many tools take (grep, git, ls): the same as --color never.
    parser.add_argument(
        "--no-color", dest="color", action="store_const", const="never", help=argparse.SUPPRESS
    )


def use_color(choice: str, stream: Any = None) -> bool:
    """Whether to colour what goes to ``stream`` (standard output by default): ``--color``
    first, then FORCE_COLOR and NO_COLOR (set and not empty; force-color.org, no-color.org),
    then TERM=dumb (a terminal that takes no escape codes: Emacs' shell, some IDE consoles),
    then whether the stream is a terminal, so that a redirected heat-map carries no escape
    codes."""
    if choice != "auto":
        return choice == "always"
    if os.environ.get("FORCE_COLOR"):
        return True
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def add_client_args(parser: argparse.ArgumentParser, timeout_note: str = "") -> None:
    """Connection flags of commands that talk to a running sidecar (``timeout_note``: what
    ``--timeout`` also bounds in this command)."""
    parser.add_argument(
        "--target",
        default=os.environ.get("LIMELIGHT_TARGET", DEFAULT_TARGET),
        help=f"sidecar address host:port (default: $LIMELIGHT_TARGET or {DEFAULT_TARGET})",
    )
    parser.add_argument(
        "--timeout",
        type=real(0.0, above=True),
        default=30.0,
        help=f"per-call deadline in seconds (default: 30){timeout_note}",
    )
    add_credential_args(parser)


def add_credential_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """TLS and bearer-token flags of commands that call a running sidecar."""
    parser.add_argument("--tls", action="store_true", help="use TLS")
    parser.add_argument("--ca-cert", type=Path, help="CA bundle that signed the server cert")
    parser.add_argument("--client-cert", type=Path, help="client certificate for mutual TLS")
    parser.add_argument("--client-key", type=Path, help="client key for mutual TLS")
    parser.add_argument(
        "--token",
        default=os.environ.get("LIMELIGHT_TOKEN"),
        help="bearer token (default: $LIMELIGHT_TOKEN)",
    )


def client_from_args(args: argparse.Namespace, connections: int = 1) -> Any:
    from limelight_client import Client

    tls = bool(args.tls or args.ca_cert or args.client_cert)
    try:
        return Client(
            args.target,
            timeout=args.timeout,
            tls=tls,
            ca_cert=args.ca_cert,
            client_cert=args.client_cert,
            client_key=args.client_key,
            token=args.token,
            connections=connections,
        )
    except ValueError as exc:  # the SDK's word on --target or the TLS files: a usage error
        raise InvalidArgument(str(exc)) from None


def _no_port(target: str) -> bool:
    """A plain host name or address without ``:port`` (``localhost``, ``[::1]``); not a
    resolver URI such as ``unix:…`` or ``dns:///…``."""
    if target.startswith("["):
        return target.endswith("]")
    return ":" not in target and "/" not in target


def client_error_status(exc: Any) -> int:
    """The exit status of a command that a failed client call ended: 2 where the sidecar
    refused an argument (INVALID_ARGUMENT: an empty text, an unknown label, a bad --param),
    as the same argument is refused in-process with ``--local``; 1 for anything else."""
    from limelight_client.errors import InvalidArgument as Refused

    return EXIT_USAGE if isinstance(exc, Refused) else EXIT_FAILURE


#: gRPC's own message for a call whose deadline passed on the client's side.
_GRPC_DEADLINE_MESSAGE = "Deadline Exceeded"


def client_error_line(
    exc: Any, target: str | None, flag: str = "--target", timeout: float | None = None
) -> str:
    """One readable line for a failed client call: the status and the server's message, or,
    when nothing answered at ``target``, where the CLI looked and how to point it elsewhere
    (the address the user gave rather than the one gRPC resolved it to); when no answer came
    within the deadline, whose it was (``--timeout``, ``timeout`` seconds) and what to try."""
    reason = getattr(exc, "reason", None)
    if reason and target and getattr(exc, "answered", False):
        # Something is there, but no sidecar this client can use: starting one would not help.
        return f"cannot reach a sidecar at {target}: {reason}"
    if reason and target:
        if _no_port(target):  # gRPC dials 443 then: easy to miss when the sidecar is local
            return (
                f"cannot reach a sidecar at {target} ({reason}): without a port gRPC dials 443; "
                f"`limelight serve` listens on 50051 unless told otherwise (--target "
                f"{target}:50051)"
            )
        return (
            f"cannot reach a sidecar at {target} ({reason}): start one with `limelight "
            f"serve`, or point {flag}"
            + (" (or LIMELIGHT_TARGET)" if flag == "--target" else "")
            + " at a running one"
        )
    code = getattr(getattr(exc, "code", None), "name", "")
    if code == "UNAVAILABLE" and target:
        # Something answered (the sidecar draining, its job queue down, a proxy without one).
        return f"the sidecar at {target} is unavailable: {getattr(exc, 'message', exc)}"
    if code == "DEADLINE_EXCEEDED" and target:
        # gRPC's bare "Deadline Exceeded" names neither the sidecar nor the flag that set it.
        within = f"within --timeout {timeout:g} s" if timeout is not None else "in time"
        message = str(getattr(exc, "message", "") or "").strip()
        said = f" ({message})" if message and message != _GRPC_DEADLINE_MESSAGE else ""
        advice = "raise --timeout or " if timeout is not None else ""
        return f"no answer from the sidecar at {target} {within}{said}; {advice}check it is serving"
    return str(exc)


def parse_params(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` flags as a dict; values parsed as JSON when they are JSON."""
    params: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise InvalidArgument(f"--param needs KEY=VALUE, got {item!r}")
        try:
            params[key] = json.loads(raw)
        except json.JSONDecodeError:
            params[key] = raw
    return params


class JobProgressBar:
    """A job's progress as one terminal line: percent, elapsed time, and the job's state with
    its stage ("running: 16/32 path points"). A rate such as tqdm's "%/s" means nothing for a
    job, so the line shows none.

    Standard error redirected to a file or a pipe (a log, CI) gets no redrawn bar, whose every
    frame would land in it, but one plain line per state (``slalom 1f2e3d4c: queued; no worker
    …``, ``… running: fitting SLALOM: epoch 1/300``, ``… succeeded: done``). ``tty`` decides
    otherwise (default: whether standard error is a terminal)."""

    def __init__(self, description: str, quiet: bool = False, tty: bool | None = None) -> None:
        from tqdm import tqdm

        self._description = description
        self._quiet = quiet
        self._state: str | None = None
        self._last = self._printed = ""
        self._bar: Any = None
        if not quiet and (sys.stderr.isatty() if tty is None else tty):
            self._bar = tqdm(
                total=100,
                desc=description,
                file=sys.stderr,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}{postfix}",
            )

    def show(self, fraction: float, message: str, state: str = "") -> None:
        line = job_status_line(state, message)
        if self._bar is None:
            self._last = line
            if state != self._state:
                self._state = state
                self._print(line)
            return
        percent = 100 * fraction if math.isfinite(fraction) else 0.0
        self._bar.n = min(100, max(0, round(percent)))
        self._bar.set_postfix_str(line[:64], refresh=False)
        self._bar.refresh()

    def __enter__(self) -> JobProgressBar:
        return self

    def _print(self, line: str) -> None:
        if not self._quiet and line:
            self._printed = line
            print(f"{self._description}: {line}", file=sys.stderr, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._last != self._printed:  # a local run has no states: its last stage
            self._print(self._last)


def job_status_line(state: str, message: str) -> str:
    """``state: message``, either alone when the other is empty or says the same (a message
    that begins with the state's word, such as "queued; no worker …", says it)."""
    state, message = state.strip(), message.strip()
    if not state or re.match(rf"{re.escape(state)}\b", message, re.IGNORECASE):
        return message
    return f"{state}: {message}" if message else state


def add_wait_timeout_arg(parser: argparse.ArgumentParser) -> None:
    """``--wait-timeout`` of the commands that follow a job until it ends."""
    parser.add_argument(
        "--wait-timeout",
        type=real(0.0, above=True),
        metavar="SECONDS",
        help="stop following the job after this long, with exit status 1 and where it stood; "
        "the sidecar keeps the job (default: until it ends; a job no worker consumes "
        "waits for one)",
    )


class JobNotFinished(Exception):
    """``follow_job`` ran out of ``timeout``; the message says where the job stood."""


def follow_job(job: Any, quiet: bool = False, timeout: float | None = None) -> None:
    """Watch an SDK job with a progress bar until it ends (or ``timeout`` seconds pass:
    ``JobNotFinished``). Interrupted (Ctrl-C), it says that the job goes on and how to find or
    cancel it: the job lives in the sidecar, not here."""
    from limelight_client.errors import DeadlineExceeded

    try:
        with JobProgressBar(f"{job.info.method} {job.id[:8]}", quiet) as bar:
            for info in job.watch(timeout):
                bar.show(info.progress, info.message, info.state.name.lower())
    except DeadlineExceeded:
        if timeout is None:
            raise
        where = str(job._not_finished(timeout))  # the SDK's own words for result(timeout)
        raise JobNotFinished(
            f"{where}; the sidecar keeps it: follow it with `limelight jobs watch "
            f"{job.id}`, or stop it with `limelight jobs cancel {job.id}`"
        ) from None
    except KeyboardInterrupt:
        state = job.info.state.name.lower()
        print(
            f"\ninterrupted: job {job.id} is still {state} on the sidecar; follow it with "
            f"`limelight jobs watch {job.id}`, or stop it with `limelight jobs cancel {job.id}`",
            file=sys.stderr,
        )
        raise


def top_token_lines(explanation: Any, k: int) -> list[str]:
    """The ``k`` tokens that most support and most oppose each explained label, one line each.

    A single list sorted by signed score would show weakly negative tokens ahead of the
    strongest evidence against the label; the two directions are listed apart instead, the
    second only when some score is negative (a non-negative method has no "against"). ``k``
    0 lists nothing (``--top 0``: the heat-map alone).
    """
    lines: list[str] = []
    if k <= 0:
        return lines
    for one in explanation.explained():  # multi-label: each explained label
        ranked = one.top(len(one.tokens))  # best first, NaN last
        support = [pair for pair in ranked if pair[1] > 0][:k]
        oppose = [pair for pair in reversed(ranked) if pair[1] < 0][:k]
        label = one.target_label
        seen = _occurrences(one)
        # The heat-map's number format: a map of scores around 1e-4 must not list "-0.000".
        scale = max((abs(s) for _, s in ranked if math.isfinite(s)), default=0.0)
        lines.append(f"for {label}: {_listed(one, support, seen, scale)}")
        if oppose:
            lines.append(f"against {label}: {_listed(one, oppose, seen, scale)}")
    return lines


Place = tuple[int, int, int]


def _place(tok: Any) -> Place:
    return (tok.segment, tok.start, tok.end)


def _occurrences(explanation: Any) -> dict[Place, tuple[int, int]]:
    """For each token whose text occurs more than once in the input: which occurrence it is
    and of how many, in text order, so that two "the" in a list can be told apart (by the
    input's own characters: two emoji the tokenizer both calls "[UNK]" are not the same)."""
    from limelight_client.render import token_text

    by_text: dict[str, list[Place]] = {}
    for tok in explanation.tokens:
        if not tok.special:
            by_text.setdefault(token_text(explanation, tok), []).append(_place(tok))
    return {
        place: (nth, len(places))
        for places in by_text.values()
        if len(places) > 1
        for nth, place in enumerate(places, start=1)
    }


def _listed(
    explanation: Any,
    pairs: list[tuple[Any, float]],
    seen: dict[Place, tuple[int, int]],
    scale: float,
) -> str:
    from limelight_client.render import format_score, terminal_safe, token_text

    # quoted: punctuation tokens ("," or ".") would otherwise read as the list's own marks
    parts = []
    for tok, score in pairs:
        where = seen.get(_place(tok))
        which = f" ({_ordinal(where[0])} of {where[1]})" if where else ""
        # The input's characters ("I", not the uncased tokenizer's "i"), with nothing in them
        # a terminal would act on (by_words() words are cut from the input as it came).
        shown = terminal_safe(token_text(explanation, tok))
        parts.append(f'"{shown}"{which} {format_score(score, scale)}')
    return ", ".join(parts) or "none"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"

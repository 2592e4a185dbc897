"""The `limelight` command. Every module in this package with a ``register(subparsers)``
function contributes one subcommand.

Errors: whatever a command raises ends here, in :func:`main`, and becomes one line on stderr
(``limelight <command>: error: <what went wrong>``) and a non-zero exit status — 2 for invalid
arguments or settings (also where the sidecar refuses one: INVALID_ARGUMENT), 1 for anything
else — with no traceback unless the log level is DEBUG
(``--log-level debug`` or ``LIMELIGHT_LOG_LEVEL=debug``). A reader that closes standard output
early (``| head``) ends a command quietly with status 141, as SIGPIPE ends Unix tools.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import difflib
import errno
import importlib
import io
import os
import pkgutil
import re
import shlex
import sys
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from limelight import __version__
from limelight.cli.common import EXIT_FAILURE, EXIT_USAGE, fail, unparsable
from limelight.errors import ErrorKind, LimelightError, redact_credentials

#: Exit status when standard output's reader went away: a shell's for a process that SIGPIPE
#: ended (128 + 13).
EXIT_BROKEN_PIPE = 141

_EPILOG = (
    "Errors are reported as one line on stderr with exit status 2 (invalid arguments or "
    "settings, the sidecar's refusal of an argument included) or 1 (anything else); "
    "--log-level debug adds the traceback."
)


def _leaf_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parsers that run a command (the innermost of nested subcommands)."""
    nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not nested:
        yield parser
        return
    for action in nested:
        for child in dict.fromkeys(action.choices.values()):
            yield from _leaf_parsers(child)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="limelight",
        description="Explanation sidecar for transformer text classifiers.",
        epilog=_EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"limelight {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    import limelight.cli as package

    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name in ("main", "common") or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"limelight.cli.{info.name}")
        register = getattr(module, "register", None)
        if callable(register):
            register(subparsers)
    # Every command takes --log-level (DEBUG also turns on tracebacks for errors).
    for leaf in dict.fromkeys(_leaf_parsers(parser)):
        if leaf is parser:
            continue
        with contextlib.suppress(argparse.ArgumentError):
            leaf.add_argument("--log-level", help="DEBUG, INFO, WARNING, ... (DEBUG: tracebacks)")
        leaf.set_defaults(_parser=leaf)  # whose usage an unknown argument is reported with
    return parser


def _after_separator(argv: Sequence[str], extra: list[str]) -> list[str]:
    """The unrecognized arguments that came after ``--`` in ``argv``: the end of ``extra``
    that is the end of what follows the first ``--`` (the command's TEXT took the first)."""
    if "--" not in argv:
        return []
    tail = list(argv[list(argv).index("--") + 1 :])
    count = min(len(extra), len(tail))
    while count and extra[len(extra) - count :] != tail[len(tail) - count :]:
        count -= 1
    return extra[len(extra) - count :]


def _unrecognized(
    args: argparse.Namespace, extra: list[str], argv: Sequence[str] | None = None
) -> str:
    """argparse's "unrecognized arguments" for the command given, with the flag of that
    command nearest to each unknown one (``--output`` -> ``--out``). After ``--`` every
    argument is text, a flag's spelling too: those are told so, with the command line that
    puts them before ``--``, rather than offered the flag they already are."""
    argv = list(sys.argv[1:] if argv is None else argv)
    leaf: argparse.ArgumentParser = getattr(args, "_parser", None) or build_parser()
    flags = [flag for action in leaf._actions for flag in action.option_strings]
    after = _after_separator(argv, extra)
    hints = []
    for word in extra:
        name = word.split("=", 1)[0]
        if name.startswith("--"):
            near = difflib.get_close_matches(name, flags, n=1, cutoff=0.6)
            if near and near[0] != name:
                hints.append(f"{name}: did you mean {near[0]}?")
    if after:
        options = [word for word in after if word.startswith("-")]
        said = "after -- every argument is text"
        if options:
            split = argv.index("--")
            rest = list(argv[split + 1 :])
            for word in options:
                rest.remove(word)
            fixed = shlex.join([*argv[:split], *options, "--", *rest])
            said += f", not an option; put options before --: {leaf.prog.split()[0]} {fixed}"
        elif any(action.dest == "text" for action in leaf._actions):
            said += ", and the command takes one: quote a text of several words"
        hints.append(said)
    message = f"unrecognized arguments: {' '.join(extra)}"
    return message + (f" ({'; '.join(hints)})" if hints else "")


def _debug_requested(args: argparse.Namespace) -> bool:
    level = getattr(args, "log_level", None) or os.environ.get("LIMELIGHT_LOG_LEVEL", "")
    return str(level).strip().upper() == "DEBUG"


#: Flags whose value is a file or folder the command writes (the rest it reads).
_OUTPUTS = frozenset({"out", "html", "plot", "output"})


def _flag_for(args: argparse.Namespace, filename: object) -> tuple[str, str, bool] | None:
    """(``--flag``, its value, whether the command writes there) for the path flag whose
    value is ``filename`` or lies under it (a folder on the way that does not exist)."""
    if filename is None:
        return None
    failed = Path(str(filename))
    for dest, value in vars(args).items():
        if not isinstance(value, str | Path) or not str(value):
            continue
        given = Path(value)
        if str(value) == str(filename) or failed in given.parents:
            flag = "--" + dest.replace("_", "-").removesuffix("-dir").removesuffix("-path")
            return flag, str(value), dest in _OUTPUTS
    return None


def _shown(value: object) -> object:
    """A rejected setting's value as an error may repeat it: a queue address may carry a
    password, also where it is too malformed to read as a URL (``redis:/user:secret@host``)."""
    if not isinstance(value, str):
        return value
    value = redact_credentials(value)
    if "@" in value and "***@" not in value:
        value = "***@" + value.rsplit("@", 1)[1]
    return value


def _setting_flag(args: argparse.Namespace | None, name: str) -> str | None:
    """The command's own option for setting ``name`` (``--viewer`` for ``viewer_enabled``),
    or None where the command has none (only its environment variable sets it)."""
    parser = getattr(args, "_parser", None) if args is not None else None
    for action in getattr(parser, "_actions", ()):
        if action.dest == name and action.option_strings:
            longs = [o for o in action.option_strings if o.startswith("--")]
            return (longs or action.option_strings)[0]
    return None


def _validation_message(exc: Any, args: argparse.Namespace | None = None) -> str:
    """pydantic's ValidationError as one line: setting, problem, offending value, and how to
    set it (the command's flag where it has one, else the environment variable)."""
    parts, combined = [], []
    for err in exc.errors():
        message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if not err.get("loc"):
            # A model validator's: settings that do not go together. Its message names them
            # and their variables (there is no LIMELIGHT_SETTINGS to set).
            combined.append(message)
            continue
        name = ".".join(str(x) for x in err["loc"])
        value = err.get("input")
        got = f" (got {_shown(value)!r})" if not isinstance(value, dict) else ""
        flag = _setting_flag(args, name.split(".")[0])
        where = f"{flag} or " if flag else ""
        parts.append(
            f"{name}: {message}{got}; set it with {where}LIMELIGHT_{name.split('.')[0].upper()}"
        )
    lines = ["invalid setting " + "; ".join(parts)] if parts else []
    if combined:
        lines.append("invalid settings: " + "; ".join(combined))
    return "; ".join(lines)


#: pydantic-settings' SettingsError: a LIMELIGHT_* value that could not even be decoded (JSON).
_UNPARSABLE_SETTING = re.compile(r'error parsing value for field "(\w+)"')


def _unparsable_setting_message(exc: BaseException) -> str | None:
    """pydantic-settings' SettingsError (an undecodable environment value) as one line."""
    match = _UNPARSABLE_SETTING.search(str(exc))
    if match is None:
        return None
    name = match.group(1)
    return f"invalid setting {name}: LIMELIGHT_{name.upper()} {unparsable(exc.__cause__)}"


_BIND_FAILURE = re.compile(r"Failed to bind to address (\S+?);?\s")


def describe_error(exc: BaseException, args: argparse.Namespace) -> tuple[str, int]:
    """(one readable line, exit status) for an exception that ended a command."""
    if isinstance(exc, LimelightError):
        status = EXIT_USAGE if exc.kind is ErrorKind.INVALID_ARGUMENT else EXIT_FAILURE
        return exc.message, status
    from limelight_client.errors import LimelightError as ClientError

    if isinstance(exc, ClientError):
        from limelight.cli.common import client_error_line, client_error_status

        line = client_error_line(
            exc, getattr(args, "target", None), timeout=getattr(args, "timeout", None)
        )
        return line, client_error_status(exc)
    if type(exc).__name__ == "ValidationError" and hasattr(exc, "errors"):
        return _validation_message(exc, args), EXIT_USAGE
    if type(exc).__name__ == "TlsConfigError":  # its message names the file and the fault
        return str(exc), EXIT_USAGE
    if type(exc).__name__ == "SettingsError":
        unparsable = _unparsable_setting_message(exc)
        if unparsable is not None:
            return unparsable, EXIT_USAGE
    if isinstance(exc, OSError):
        if exc.errno == errno.EADDRINUSE:
            port = getattr(args, "metrics_port", None)
            where = f" (metrics port {port})" if port else " (the metrics port)"
            return (
                f"address already in use{where}: another process listens there; pick another "
                "--metrics-port (0 turns the metrics endpoint off)",
                EXIT_FAILURE,
            )
        if exc.filename is not None:
            found = _flag_for(args, exc.filename)
            reason = exc.strerror or str(exc)
            if found is None:
                return f"cannot read {exc.filename}: {reason}", EXIT_FAILURE
            flag, value, writes = found
            if value != str(exc.filename):  # a folder on its way
                reason = f"{reason} ({exc.filename})"
            verb = "write" if writes else "read"
            return f"cannot {verb} {flag} {value}: {reason}", EXIT_FAILURE
        return str(exc.strerror or exc), EXIT_FAILURE
    if isinstance(exc, RuntimeError):
        match = _BIND_FAILURE.search(str(exc) + " ")
        if match:
            return (
                f"cannot listen on {match.group(1)}: the port is in use or the address is not "
                "available here; pick another --port or --host",
                EXIT_FAILURE,
            )
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return (
        f"{type(exc).__name__}: {text or 'unexpected failure'} "
        "(run with --log-level debug for the traceback)",
        EXIT_FAILURE,
    )


def _escape_else_replace(exc: UnicodeError) -> tuple[str | bytes, int]:
    """An encoding error handler: bytes read as surrogates (``surrogateescape``) written back
    as those bytes, any other character the encoding lacks as ``?``."""
    try:
        return codecs.lookup_error("surrogateescape")(exc)
    except UnicodeError:
        return codecs.lookup_error("replace")(exc)


codecs.register_error("limelight.escape_else_replace", _escape_else_replace)


@contextlib.contextmanager
def _unwritable_replaced(stream: Any) -> Iterator[None]:
    """While a command runs, a character ``stream`` (standard output) cannot encode prints as
    ``?`` instead of ending the command with a UnicodeEncodeError and its result lost (an
    ASCII or Latin-1 terminal, ``PYTHONIOENCODING=ascii``, the POSIX locale): a token, a
    label, a job's message. Bytes read as surrogates under the POSIX locale still pass."""
    errors = getattr(stream, "errors", None)
    if not isinstance(stream, io.TextIOWrapper) or errors not in ("strict", "surrogateescape"):
        yield
        return
    stream.reconfigure(errors="replace" if errors == "strict" else "limelight.escape_else_replace")
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):  # closed, or its reader gone
            stream.reconfigure(errors=errors)


def main(argv: Sequence[str] | None = None) -> int:
    # gRPC's core logs below its documented default level (ERROR) until something sets one:
    # a failed TLS handshake printed an INFO line above the command's own one-line error.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    with _unwritable_replaced(sys.stdout):
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the command's own parser: its usage, its name in the message
        (getattr(args, "_parser", None) or parser).error(_unrecognized(args, extra, argv))
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except SystemExit:
        raise
    except BrokenPipeError:
        # The reader left (`limelight jobs list | head -3`): stop without a word, as Unix tools
        # do, and keep Python's own flush at exit from failing on the closed pipe again.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as exc:
        message, status = describe_error(exc, args)
        if _debug_requested(args):
            traceback.print_exc(file=sys.stderr)
        return fail(args, message, status)


if __name__ == "__main__":
    sys.exit(main())

"""`limelight bench --against HOST:PORT`: load a sidecar that is already serving.

The same closed-loop load generator as the served and mix sections (its own process, here),
pointed at a deployed sidecar — another machine, a cluster behind TLS and tokens — instead of
one this command starts. What needs the model on this machine (the in-process baselines, the
inline and jobs sections, the server's CPU) is not measured: latency, throughput and errors
are, at each client count, and short requests' latency with long ones in the mix.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from limelight.cli.common import client_error_line
from limelight.errors import InvalidArgument


def _short_texts(args: argparse.Namespace) -> list[str]:
    if args.texts is not None:
        try:
            lines = args.texts.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"--texts {args.texts}: {exc}") from None
        texts = [line.strip() for line in lines if line.strip()]
        if not texts:
            raise InvalidArgument(f"--texts {args.texts}: no text in it (one per line)")
        return texts
    from limelight.demo.datasets import rotten_tomatoes

    reviews = [e.text for e in rotten_tomatoes("test")]
    return sorted(reviews, key=len)[len(reviews) // 4 :][:64]  # as the local served section


def _security(args: argparse.Namespace) -> dict[str, Any]:
    tls = bool(args.tls or args.ca_cert or args.client_cert)
    if bool(args.client_cert) != bool(args.client_key):
        raise InvalidArgument("--client-cert and --client-key go together")
    for flag in ("ca_cert", "client_cert", "client_key"):
        path = getattr(args, flag)
        if path is not None and not Path(path).is_file():
            raise InvalidArgument(f"--{flag.replace('_', '-')} {path}: no such file")
    return {
        "tls": tls,
        "ca_cert": str(args.ca_cert) if args.ca_cert else None,
        "client_cert": str(args.client_cert) if args.client_cert else None,
        "client_key": str(args.client_key) if args.client_key else None,
        "token": args.token,
    }


def _served_model(args: argparse.Namespace, security: dict[str, Any]) -> Any:
    """What the sidecar serves, asked once through the SDK: a wrong address, certificate or
    token is one readable line here rather than a load of failed calls."""
    from limelight_client import Client
    from limelight_client.errors import LimelightError

    target = args.against
    if args.rpc == "http":  # the HTTP port answers KServe, not gRPC: ask its model list
        return _http_model(target, security)
    try:
        with Client(
            target,
            timeout=30,
            tls=security["tls"],
            ca_cert=args.ca_cert,
            client_cert=args.client_cert,
            client_key=args.client_key,
            token=args.token,
        ) as client:
            return client.model()
    except ValueError as exc:  # the SDK's word on the address
        raise InvalidArgument(f"--against: {exc}") from None
    except LimelightError as exc:
        raise InvalidArgument(client_error_line(exc, target, "--against")) from None


def _http_model(target: str, security: dict[str, Any]) -> Any:
    import http.client
    import json
    import ssl
    import urllib.error
    import urllib.request
    from types import SimpleNamespace

    scheme = "https" if security["tls"] else "http"
    context = None
    if security["tls"]:
        context = ssl.create_default_context(cafile=security["ca_cert"])
        if security["client_cert"]:
            context.load_cert_chain(security["client_cert"], security["client_key"])
    request = urllib.request.Request(f"{scheme}://{target}/v1/models")
    if security["token"]:
        request.add_header("Authorization", f"Bearer {security['token']}")
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as reply:
            (name,) = json.load(reply)["models"]
    except urllib.error.HTTPError as exc:  # it answered: say what (401: the token)
        raise InvalidArgument(
            f"{scheme}://{target}/v1/models answered {exc.code} {exc.reason}"
        ) from None
    except (OSError, ValueError, KeyError, http.client.HTTPException) as exc:
        # A gRPC port answers HTTP/1.1 with an HTTP/2 frame: a "bad status line".
        reason = type(exc).__name__ if isinstance(exc, http.client.HTTPException) else exc
        raise InvalidArgument(
            f"cannot read the model list at {scheme}://{target}/v1/models ({reason}): with "
            "--rpc http, --against is the sidecar's HTTP port (--metrics-port, 9464 by default)"
        ) from None
    return SimpleNamespace(name=name, version="", runtime="", workers=0)


def run_against(args: argparse.Namespace) -> int:
    from limelight.cli.bench import MIX_COLUMNS, long_texts, mix_title
    from limelight.evaluation import benchmark as b

    sections = [s for s in args.sections if s in ("served", "mix")]
    if not sections:
        raise InvalidArgument(
            "--against measures a running sidecar: the served and mix sections (inline and jobs "
            "run the model on this machine)"
        )
    if args.mix is None and sections == ["mix"]:
        raise InvalidArgument("--sections mix needs --mix SHORT+LONG")
    security = _security(args)
    short = _short_texts(args)
    model = _served_model(args, security)
    channels = args.channels or 1
    duration = min(args.duration, 3.0) if args.quick else args.duration
    warmup = min(args.load_warmup, 1.0) if args.quick else args.load_warmup
    args.out.mkdir(parents=True, exist_ok=True)
    served_by = f"model {model.name}"
    if model.version:
        served_by += f" (version {model.version}, {model.runtime}, {model.workers} worker(s))"
    report = [
        f"sidecar: {args.against}, {served_by}",
        f"load generator on: {b.machine()}",
        f"command: limelight bench {' '.join(_argv(args))}",
    ]
    print("\n".join(report), flush=True)

    def emit(title: str, table: str, note: str) -> None:
        report.extend(["", f"## {title}", "", table, "", note])
        print(f"\n## {title}\n\n{table}\n\n{note}", flush=True)

    def load(texts: dict[str, list[str]], clients: dict[str, int]) -> b.LoadResult:
        return b.run_load(
            args.against,
            texts,
            clients,
            duration,
            warmup,
            None,
            channels,
            args.rpc,
            args.spread,
            args.texts_per_call,
            args.token_layout,
            security,
        )

    calls = f"{args.rpc} calls, " + (
        "one HTTP connection per client" if args.rpc == "http" else f"{channels} gRPC channel(s)"
    )
    points: list[dict[str, Any]] = []
    if "served" in sections:
        rows = []
        for n in args.clients:
            result = load({"short": short}, {"short": n})
            point = {
                "clients": n,
                "p50": result.p50_ms("short"),
                "p99": result.p99_ms("short"),
                "per_s": result.per_s(),
                "errors": result.errors,
            }
            points.append(point)
            rows.append([n, point["p50"], point["p99"], point["per_s"], result.errors])
            print(
                f"{n} client(s): p50 {point['p50']:.3g} ms, p99 {point['p99']:.3g} ms, "
                f"{point['per_s']:,.0f} req/s, {result.errors} error(s)",
                flush=True,
            )
        emit(
            "Served, as deployed (short texts)",
            b.markdown_table(["clients", "p50 ms", "p99 ms", "req/s", "errors"], rows),
            f"Closed loop from a separate process on this machine ({calls}), {duration:g} s "
            f"measured per point after {warmup:g} s of load; {len(short)} texts. Latency "
            "includes the network between this machine and the sidecar; the sidecar's CPU is "
            "not measured from here (its `limelight_*` metrics are).",
        )
    if "mix" in sections and args.mix:
        n_short, n_long = args.mix
        longs = long_texts(short, args.long_chars, 16)
        alone = load({"short": short}, {"short": n_short})
        mixed = load({"short": short, "long": longs}, {"short": n_short, "long": n_long})
        ratio = mixed.p50_ms("short") / alone.p50_ms("short")
        emit(
            mix_title(n_short, n_long, args.long_chars),
            b.markdown_table(
                [*MIX_COLUMNS, "errors"],
                [
                    [
                        alone.p50_ms("short"),
                        mixed.p50_ms("short"),
                        ratio,
                        mixed.p99_ms("short"),
                        mixed.per_s("short"),
                        mixed.per_s("long"),
                        mixed.p50_ms("long"),
                        alone.errors + mixed.errors,
                    ]
                ],
            ),
            f"Long texts are the short ones joined ({calls}).",
        )
        print(f"mixed lengths: short p50 {ratio:.2f}x with long texts in the mix", flush=True)
    (args.out / "bench.md").write_text("\n".join(report) + "\n")
    if points:
        _plot(points, args.against, args.out / "bench.png")
    print(f"\nwrote {args.out / 'bench.md'}")
    return 0


def _plot(points: list[dict[str, Any]], target: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    clients = [p["clients"] for p in points]
    left.plot(clients, [p["per_s"] for p in points], marker="o")
    left.set_ylabel("requests / s")
    left.set_title(f"Throughput at {target}")
    right.plot(clients, [p["p50"] for p in points], marker="o", label="p50")
    right.plot(clients, [p["p99"] for p in points], marker="o", label="p99")
    right.set_ylabel("latency, ms")
    right.set_title("Latency")
    right.legend(fontsize=8)
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent clients (separate process)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _argv(args: argparse.Namespace) -> list[str]:
    """The command line that reproduces the run, without credentials."""
    from limelight.cli.bench import changed_load_options

    out = ["--against", args.against]
    if args.texts is not None:
        out += ["--texts", str(args.texts)]
    out += ["--sections", ",".join(s for s in args.sections if s in ("served", "mix"))]
    out += ["--clients", ",".join(map(str, args.clients)), "--rpc", args.rpc]
    if "mix" in args.sections:
        out += ["--mix", "+".join(map(str, args.mix)) if args.mix else ""]
    if args.channels is not None:
        out += ["--channels", str(args.channels)]
    if args.rpc == "batch":
        out += ["--texts-per-call", str(args.texts_per_call)]
    if args.rpc != "http" and args.token_layout != "columns":
        out += ["--token-layout", args.token_layout]
    out += ["--duration", f"{args.duration:g}"]
    out += changed_load_options(args)
    if args.tls or args.ca_cert or args.client_cert:
        out.append("--tls")
    if args.quick:
        out.append("--quick")
    return out

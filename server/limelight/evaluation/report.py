"""Write an evaluation as a Markdown table, a JSON file and PNG plots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from limelight.evaluation.figures import decimals, flat_note, plus_minus
from limelight.evaluation.runner import EvalConfig, MethodResult, paired_difference


@dataclass
class EvalReport:
    """One evaluation run: what was measured on what, and every method's result."""

    model: str
    dataset: str
    config: EvalConfig
    results: list[MethodResult]
    accuracy: float | None = None
    """The model's accuracy on the sampled examples that have a gold label."""
    notes: list[str] = field(default_factory=list)
    command: str = ""
    machine: str = ""
    inputs: list[dict[str, Any]] = field(default_factory=list)
    """Per evaluated item, in the order of the per-input figures: ``index`` (position in the
    dataset) and ``target`` (the explained class of a multi-label item, else None) — what
    `limelight eval-pool` matches runs by."""

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "dataset": self.dataset,
            "accuracy": self.accuracy,
            "command": self.command,
            "machine": self.machine,
            "notes": self.notes,
            "config": {
                "fractions": list(self.config.fractions),
                "game_fractions": list(self.config.game_fractions),
                "replace": self.config.replace,
                "overlap_ks": list(self.config.overlap_ks),
                "max_tokens": self.config.max_tokens,
                "label_thresholds": self.config.label_thresholds,
            },
            "inputs": self.inputs,
            "methods": [r.to_json() for r in self.results],
        }


def _f(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _pm(value: float | None, se: float | None, places: int = 3) -> str:
    return "–" if value is None else plus_minus(value, se, places)


def _paired(results: list[MethodResult]) -> list[str]:
    """Paired differences of the first method against every other one, same inputs."""
    if len(results) < 2 or not results[0].aopc_deletion_per_input:
        return []
    first = results[0]
    lines = [
        "",
        f"Paired differences, `{first.name}` minus each method (same inputs; ± standard error "
        "of the difference):",
        "",
        "| method | Δ AOPC deletion | Δ AOPC sufficiency |",
        "|---|---|---|",
    ]
    rows = []
    for other in results[1:]:
        if len(other.aopc_deletion_per_input) != len(first.aopc_deletion_per_input):
            continue
        d = paired_difference(first.aopc_deletion_per_input, other.aopc_deletion_per_input)
        s = paired_difference(first.aopc_sufficiency_per_input, other.aopc_sufficiency_per_input)
        rows.append((other.name, d, s))
    d_places = decimals(x for _, d, _ in rows for x in d)
    s_places = decimals(x for _, _, s in rows for x in s)
    for name, d, s in rows:
        lines.append(
            f"| {name} | {plus_minus(*d, d_places, signed=True)} "
            f"| {plus_minus(*s, s_places, signed=True)} |"
        )
    return lines


def markdown(report: EvalReport) -> str:
    """The results table (and skipped methods) in Markdown."""
    ks = report.config.overlap_ks
    k_mid = 10 if 10 in ks else ks[0]
    lines = [
        f"**Model** `{report.model}` · **data** {report.dataset} · "
        f"**replacement** {report.config.replace} · "
        f"**model accuracy** {_f(report.accuracy)}",
        "",
        "| method | AOPC deletion ↑ | AOPC sufficiency ↓ | hide AUC ↓ | reveal AUC ↑ "
        f"| hide agr. AUC ↓ | reveal agr. AUC ↑ | overlap@{k_mid} ↓ | evidence AP ↑ "
        "| evidence dot ↑ | ms / expl. |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    skipped = []
    ok = [r for r in report.results if r.status == "ok"]
    deletion = decimals(x for r in ok for x in (r.aopc_deletion, r.aopc_deletion_se))
    sufficiency = decimals(x for r in ok for x in (r.aopc_sufficiency, r.aopc_sufficiency_se))
    for r in report.results:
        if r.status != "ok":
            skipped.append(f"- `{r.name}`: {r.status} — {r.reason}")
            continue
        lines.append(
            f"| {r.name} | {_pm(r.aopc_deletion, r.aopc_deletion_se, deletion)} "
            f"| {_pm(r.aopc_sufficiency, r.aopc_sufficiency_se, sufficiency)} | {_f(r.hide_auc)} "
            f"| {_f(r.reveal_auc)} | {_f(r.hide_agreement_auc)} | {_f(r.reveal_agreement_auc)} "
            f"| {_f(r.overlap.get(k_mid))} | {_f(r.evidence_ap)} | {_f(r.evidence_dot)} "
            f"| {_f(r.mean_ms, 1)} |"
        )
    n = ok[0].n if ok else 0
    n_gold = ok[0].n_gold if ok else 0
    lines += [
        "",
        f"n = {n} inputs ({n_gold} with a gold label for the games); ± is the standard error "
        "over inputs. AOPC fractions: "
        + ", ".join(f"{f:g}" for f in report.config.fractions)
        + f"; overlap over k = {', '.join(map(str, ks))} in the JSON.",
    ]
    thresholds = report.config.label_thresholds
    if thresholds:  # they decide which (text, label) items there are
        shown = ", ".join(f"{label} {value}" for label, value in thresholds.items())
        lines[-1] += (
            f" Label thresholds in force (an item per text and label at or over its threshold): "
            f"{shown}."
        )
    lines += _paired(ok)
    if skipped:
        lines += ["", "Not evaluated:", *skipped]
    notes = list(report.notes)
    flat = flat_note((r.aopc_deletion for r in ok), report.config.fractions)
    if flat:
        notes.append(flat)
    if notes:
        lines += ["", "Notes:", *[f"- {note}" for note in notes]]
    return "\n".join(lines) + "\n"


def plot(report: EvalReport, path: Path) -> None:
    """One PNG: deletion, sufficiency, hiding and revealing curves, token overlap, time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report.results if r.status == "ok"]
    cfg = report.config
    games_gold = any(r.hide_accuracy for r in ok)
    game_y = "accuracy (gold)" if games_gold else "agreement with the original prediction"
    fig, grid = plt.subplots(2, 3, figsize=(16, 8.5))
    axes = list(grid.flat)
    panels: Sequence[tuple[str, str, Sequence[float], str]] = [
        ("Deletion: p drop (higher = more faithful)", "deletion_curve", cfg.fractions, "p drop"),
        (
            "Sufficiency: p drop keeping only top-k (lower = better)",
            "sufficiency_curve",
            cfg.fractions,
            "p drop",
        ),
        (
            "Hiding game (lower = better)",
            "hide_accuracy" if games_gold else "hide_agreement",
            cfg.game_fractions,
            game_y,
        ),
        (
            "Revealing game (higher = better)",
            "reveal_accuracy" if games_gold else "reveal_agreement",
            cfg.game_fractions,
            game_y,
        ),
    ]
    for ax, (title, attr, xs, ylabel) in zip(axes, panels, strict=False):
        for r in ok:
            ys = getattr(r, attr)
            if ys:
                style = "--" if r.name == "random" else "-"
                ax.plot(list(xs), ys, style, marker="o", markersize=3, label=r.name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("fraction of tokens perturbed / kept")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax = axes[4]
    for r in ok:
        ks = [k for k, v in r.overlap.items() if v is not None]
        if ks:
            style = "--" if r.name == "random" else "-"
            ax.plot(ks, [r.overlap[k] for k in ks], style, marker="o", markersize=3, label=r.name)
    ax.set_title("Token overlap across predicted classes (lower = better)", fontsize=10)
    ax.set_xlabel("top k tokens per class")
    ax.set_ylabel("share of top-k shared with another class")
    ax.grid(alpha=0.3)
    ax = axes[5]
    timed = [r for r in ok if r.median_ms is not None]
    ax.barh([r.name for r in timed], [max(r.median_ms or 0.0, 1e-3) for r in timed])
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_title("Median time per explanation (ms, log scale)", fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    if axes[0].get_legend_handles_labels()[0]:  # no method drew a curve: no empty legend
        axes[0].legend(fontsize=8)
    fig.suptitle(f"{report.model} · {report.dataset} · replacement: {cfg.replace}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def load(path: Path) -> EvalReport:
    """An :class:`EvalReport` back from its JSON file (to re-render the table or plots)."""
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    cfg = raw["config"]
    config = EvalConfig(
        fractions=tuple(cfg["fractions"]),
        game_fractions=tuple(cfg["game_fractions"]),
        replace=cfg["replace"],
        overlap_ks=tuple(cfg["overlap_ks"]),
        max_tokens=cfg["max_tokens"],
        label_thresholds=cfg.get("label_thresholds"),  # written since multi-label runs say them
    )
    names = set(MethodResult.__dataclass_fields__)
    results = []
    for m in raw["methods"]:
        values = {k: v for k, v in m.items() if k in names}
        values["overlap"] = {int(k): v for k, v in m.get("overlap", {}).items()}
        results.append(MethodResult(**values))
    return EvalReport(
        model=raw["model"],
        dataset=raw["dataset"],
        config=config,
        results=results,
        accuracy=raw.get("accuracy"),
        notes=list(raw.get("notes", [])),
        command=raw.get("command", ""),
        machine=raw.get("machine", ""),
        inputs=list(raw.get("inputs", [])),
    )


def write(report: EvalReport, out: Path, stem: str = "eval") -> dict[str, Path]:
    """Write ``<stem>.md``, ``<stem>.json`` and ``<stem>.png`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "markdown": out / f"{stem}.md",
        "json": out / f"{stem}.json",
        "png": out / f"{stem}.png",
    }
    paths["markdown"].write_text(markdown(report), encoding="utf-8")
    paths["json"].write_text(json.dumps(report.to_json(), indent=2), encoding="utf-8")
    plot(report, paths["png"])
    return paths

"""Server paths out of what clients read.

The messages of errors, failed jobs and methods that cannot run name the files an operator
must fix ("create one with `limelight distill --model /srv/models/x`"). The server's log keeps
them whole; a client, which may belong to another team, reads the same message with each known
directory replaced by what it is (``<model dir>``), so the server's file layout does not leak.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from limelight.models.loaded import LoadedModel
    from limelight.settings import Settings

#: A path ends where no file-name character follows ("/srv/models/x" is not in "/srv/models/xy").
_END = r"(?![\w.-])"


class PathRedactor:
    """Replaces each named directory (as given and resolved) in a text by its name; the
    longest first, so a model under the cache is named as the model."""

    def __init__(self, names: Mapping[str, Path | None]) -> None:
        forms: dict[str, str] = {}
        for name, path in names.items():
            if path is None:
                continue
            given = Path(path).expanduser()
            for form in (str(given), str(given.resolve())):
                if form not in ("", "/", "."):
                    forms.setdefault(form, name)
        ordered = sorted(forms, key=len, reverse=True)
        self._names = forms
        self._pattern = (
            re.compile("|".join(f"{re.escape(form)}{_END}" for form in ordered))
            if ordered
            else None
        )

    def __call__(self, text: str) -> str:
        if self._pattern is None or not text:
            return text
        return self._pattern.sub(lambda found: self._names[found.group(0)], text)

    @classmethod
    def of(cls, settings: Settings, model: LoadedModel) -> PathRedactor:
        """The directories a sidecar or worker's messages may name."""
        return cls(
            {
                "<model dir>": model.directory,
                "<LM head dir>": settings.lm_head_dir,
                "<cache dir>": settings.cache_dir,
                "<jobs dir>": settings.resolved_jobs_db().parent,
                "~": Path.home(),
            }
        )

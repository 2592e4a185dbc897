"""Logging filters that turn a library's report of a client's mistake into one line."""

from __future__ import annotations

import logging
from typing import ClassVar


class LibraryLogFilter(logging.Filter):
    """A filter on one library logger (``LOGGER``), installed once however many servers start."""

    LOGGER: ClassVar[str]

    @classmethod
    def install(cls) -> None:
        logger = logging.getLogger(cls.LOGGER)
        if not any(isinstance(f, cls) for f in logger.filters):
            logger.addFilter(cls())

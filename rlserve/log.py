"""rlserve's log output: its own loggers (`rlserve.*`) to stderr at the level the command asks for, in every process
of the engine, without touching the root logger that libraries and the user's code share."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


def configure_logging(level: int | str) -> None:
    logger = logging.getLogger("rlserve")
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    if not any(getattr(h, "_rlserve", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        handler._rlserve = True
        logger.addHandler(handler)
        logger.propagate = False

"""The one log line each decision of the shared-prefix path gets per process: every
builder, backend and layer of an engine decides the same, so each message is said once."""

from __future__ import annotations

import logging


class Announcer:
    """Logs each distinct message once, at INFO, under the engine's logger."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.said: set[str] = set()

    def __call__(self, message: str) -> None:
        if message not in self.said:
            self.said.add(message)
            self.logger.info("Feather shared-prefix attention: %s", message)

"""``RequestView``: how an adapter reads its engine's request type, all an adapter implements.

``R`` is the engine's request type and ``RequestId`` its requests' ids; every room of the
runtime reads requests through the view, so nothing in ``core`` imports an engine.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol, TypeVar

R = TypeVar("R")
RequestId = Hashable


class RequestView(Protocol[R]):
    """How an adapter reads its engine's request type.  ``request_id`` is best an
    ``operator.attrgetter`` (the runtime maps it over the running list twice a pass)."""

    def request_id(self, request: R) -> RequestId: ...

    def chunk_keys(self, request: R) -> list:
        """The prompt's cumulative chunk keys (see ``cht``)."""

    def prompt_tokens(self, request: R) -> int:
        """Prompt length; a request whose prompt grew (a streaming session) is re-keyed."""

    def arrival_s(self, request: R) -> float | None:
        """Arrival time on the queue's clock, or None for now."""

    def priority(self, request: R) -> int:
        """Priority class, lower more urgent (0 where the engine has no priorities)."""

    # Optional: ``tenant(request) -> Hashable``, whom the request is served for (OpenAI's
    # ``user``, a header); a view without it puts every request in ``DEFAULT_TENANT``.

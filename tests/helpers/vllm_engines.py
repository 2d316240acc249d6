"""Ending an in-process vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) at a known time.

vLLM's in-process engine freezes the garbage collector at start-up (``gc.freeze()``) and
shuts down, from a finalizer, when it is collected, tearing down vLLM's process-wide
parallel groups (``cleanup_dist_env_and_memory``).  An engine merely dropped is frozen
garbage until another engine's shutdown unfreezes it, and is then shut down by whichever
collection finds it: under the next test's live engine, whose groups go with it
("pipeline model parallel group is not initialized").  So a test ends its engines here.
"""

from __future__ import annotations

import gc
from typing import Any


def shut_down(llm: Any) -> None:
    """Shut ``llm`` down now, then collect any other engine its shutdown unfroze, while no
    engine of the test is running."""
    llm.llm_engine.engine_core.shutdown()
    gc.collect()

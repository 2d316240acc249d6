"""Import stand-ins that let SGLang's scheduler code import on a CPU-only machine.

SGLang 0.5.23 imports ``torchvision.transforms`` at module level, for multimodal models
only, and PyPI's torchvision does not load beside the CPU build of torch that vLLM
pins (``scripts/setup.sh`` removes it).  ``prepare_sglang_import`` puts an import-only
torchvision on ``sys.path`` when no torchvision is installed: every *use* of it raises,
so nothing can silently run on it; text models never use it.  Where a real torchvision
is installed (a GPU image) this does nothing.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).parent


def prepare_sglang_import() -> bool:
    """Make ``import sglang...`` work without torchvision; True if the stand-in was added.

    Children started by SGLang inherit it through ``PYTHONPATH``.
    """
    if importlib.util.find_spec("torchvision") is not None:
        return False
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
        import os

        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
    return True

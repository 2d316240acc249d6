"""Test-wide set-up: import stand-ins for engine dependencies that cannot load here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

STAND_INS = Path(__file__).parent / "stand_ins"

if importlib.util.find_spec("torchvision") is None:
    sys.path.insert(0, str(STAND_INS))

"""Files Feather writes (replaced atomically, so no reader ever sees half of one) and the
JSON files it reads back."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def replace_atomically(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` so a reader sees the old file or the new, never half.

    The text goes to a temporary file in the same directory, is flushed to disk, and is
    renamed over ``path``; on any error the temporary file is removed and the error
    raised, with ``path`` untouched.
    """
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def read_json(path: str | Path) -> Any:
    """The JSON document in ``path`` (``NaN`` and ``Infinity`` read as floats, for the
    loader to judge); ValueError naming the file if it is not JSON, OSError if it cannot
    be read."""
    try:
        return json.loads(Path(path).read_bytes())
    except (ValueError, RecursionError) as error:  # undecodable bytes, bad JSON, nesting
        raise ValueError(f"{path}: not JSON ({error})") from None

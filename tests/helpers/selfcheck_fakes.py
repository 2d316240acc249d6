"""A self-check trial whose two paths agree exactly: for tests of what runs the check
(its process, its memory, its timing), not of a kernel."""

from __future__ import annotations

import torch

from feather_sched.attention.selfcheck import Cell


class ExactTrial:
    """Both paths return the same output; no float64 reference."""

    def __init__(self, cell: Cell) -> None:
        self.cell = cell
        self.out = torch.ones(cell.rows, 4, 16)

    def engine(self) -> torch.Tensor:
        return self.out

    def shared(self) -> torch.Tensor:
        return self.out

    def reference(self) -> None:
        return None

"""Model configurations shipped with the package (config.json only: random weights)."""

from pathlib import Path

TINY_LLAMA = Path(__file__).parent / "tiny-llama"
"""A 2-layer Llama (hidden 512, 8 query and 8 KV heads of 64) for CPU runs with dummy weights."""

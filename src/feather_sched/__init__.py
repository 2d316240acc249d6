"""feather-sched: a prefix-aware request scheduler for LLM inference engines."""

__version__ = "0.1.0"

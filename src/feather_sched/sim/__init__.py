"""Serving simulator: hardware and model profiles, a step-cost model and its calibration."""

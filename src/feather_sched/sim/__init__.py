"""Serving simulator: engine, block pool, policies and replicas, costed by
``feather_sched.costmodel``."""

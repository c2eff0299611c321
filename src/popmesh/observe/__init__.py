"""Seeing a run: step timers, timing and load-imbalance reports, distributed statistics."""

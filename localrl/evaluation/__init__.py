"""Measuring: held-out evaluation (the one path every run, ``localrl eval``, the TUI and the benchmarks use),
analysis of a run's metrics, learning-curve plots, and the benchmarks (speed, export, memory)."""

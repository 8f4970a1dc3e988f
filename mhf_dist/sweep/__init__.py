"""Sweeps on Ray Tune: matched baselines, seed stability and grids."""

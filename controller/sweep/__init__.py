"""Sweeps: a grid of cells fanned out over SSH boxes (or a Slurm job array), each cell its own
run with its own paths, and the reconciliation gate before any box is taken down."""

"""Fakes at the seams where nothing real can run on a machine without the hardware: a fake
``pynvml`` (NVML) for the GPU probe. A test that puts this directory on a path has "fake" in its
name."""

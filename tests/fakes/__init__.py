"""Fakes at the hardware boundary: stand-ins that let GPU code paths run on a CPU-only machine."""

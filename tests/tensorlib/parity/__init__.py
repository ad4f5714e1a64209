"""Differential tests: tensorlib against PyTorch (CPU) on identical inputs."""

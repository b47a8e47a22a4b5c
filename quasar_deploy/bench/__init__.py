"""Measuring the speed claims: end to end (``e2e``), the verify step and kernels (``micro``), the exported ONNX forms (``onnx``).

Submodules import torch; this package and ``modes`` do not, so the CLI can list modes without it."""

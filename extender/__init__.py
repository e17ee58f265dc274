"""vramsched: a VRAM-aware kube-scheduler extender for GPU inference pods."""

__version__ = "0.1.0"

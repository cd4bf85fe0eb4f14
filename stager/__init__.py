"""stager: stage model weights and Engram row shards onto node-local NVMe, verified."""

__version__ = "0.1.0"

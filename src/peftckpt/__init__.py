"""peftckpt: adapter-sized, reshardable, crash-safe distributed checkpoints for PEFT."""

__version__ = "0.1.0"

__all__ = ["__version__"]

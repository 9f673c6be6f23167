"""Plain-PyTorch model code (no parallel code)."""
from .llama import Transformer

__all__ = ["Transformer"]

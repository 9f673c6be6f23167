"""Specs, FLOPs, memory, communication and step-time models (vectorized numpy)."""

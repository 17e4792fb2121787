"""Benchmarks, load generation, local vLLM-CPU backends and tiny models."""

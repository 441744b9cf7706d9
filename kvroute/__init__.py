"""kvroute: a KV-aware router for LLM serving. The command line lives in :mod:`kvroute.cli`."""

__version__ = "0.1.0"

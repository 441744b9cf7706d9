"""Cython sources of kvroute's compiled core; see ``indexer/`` for the pure-Python reference."""

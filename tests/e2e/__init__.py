"""End to end: the real processes started on loopback and always stopped by PID (shared servers in
tests/conftest.py)."""

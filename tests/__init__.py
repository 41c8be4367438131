"""Test suite (not installed): run with `python -m pytest tests` from the repository root."""

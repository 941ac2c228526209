"""Blind planted-bug cases written from public bug reports (see FIRST_RUN.md)."""

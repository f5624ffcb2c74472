"""Foundations every room uses: the user-facing error, config field checks, command-line helpers."""

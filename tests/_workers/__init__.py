"""Helpers that the reliability tests run in this process or in child processes."""

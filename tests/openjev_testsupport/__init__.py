"""Test support for openjev-serving. Nothing here is imported by the serving code."""

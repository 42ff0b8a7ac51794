"""Test helpers that are real services, not mocks (e.g. an OpenAI-compatible server on loopback)."""

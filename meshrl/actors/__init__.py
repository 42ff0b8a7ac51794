"""Monarch actors: thin wrappers that own a resource (engine, model, verifier) and call library code."""

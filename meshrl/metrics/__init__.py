"""A run's metrics: written as JSON lines (`records`), drawn as curves (`curves`)."""

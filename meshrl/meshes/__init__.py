"""Proc-mesh layout: spawning the run's actor meshes with co-location and readiness deadlines."""

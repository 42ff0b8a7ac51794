"""Launchers: where the controller gets its hosts from (this machine for now)."""

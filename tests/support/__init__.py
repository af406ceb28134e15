"""Shared test support: tiny configs and models, layout helpers."""

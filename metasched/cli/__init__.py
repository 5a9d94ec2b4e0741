"""Command-line apps (Hydra)."""

"""Gymnasium environments over the metasched scheduling core."""

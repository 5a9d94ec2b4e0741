"""The Hydra configs shipped with metasched (package data: ``metasched.configs``)."""

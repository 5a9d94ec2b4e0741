"""The trained policies shipped with metasched (package data: ``metasched.checkpoints``)."""

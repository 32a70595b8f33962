"""Probing this machine: versions, accelerators, memory (the `env` operation)."""

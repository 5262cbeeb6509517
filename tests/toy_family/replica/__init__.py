"""Replica-side code of the toy graph (stage replicas only)."""

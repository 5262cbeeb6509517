"""Replica-side code of the GLM-Image graph (loaded by its stages' deployments only)."""

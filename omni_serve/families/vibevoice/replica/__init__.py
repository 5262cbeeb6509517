"""Replica-side code of the VibeVoice graph (loads model code: never imported by the ingress)."""

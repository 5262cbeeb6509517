"""Replica-side code of the Omni kit: the encoder and thinker runners and programs, the streamed-input audio
programs' lifecycle. Imported only by the stage replicas (and in-process graphs); the ingress never loads it.
"""

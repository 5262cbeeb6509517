"""HTTP API layer: OpenAI protocol models, errors, media codecs and SSE framing.

Pure Python (pydantic, numpy, scipy, soundfile, PIL, FastAPI): no Ray, no torch,
no model code. Import the submodules directly; nothing is re-exported here.
"""

"""The diffusion kit: text encoder -> DiT denoising loop -> VAE, the parts image families share.

- ``messages``: the stage calls (``TextEncodeCall``, ``DenoiseCall``, ``DecodeCall``), their outputs and the
  edge payloads (``PromptEmbeds``, ``FinalLatents``);
- ``params``: the text encoder, DiT (cache-dit, packed linears) and VAE stage sections;
- ``spec``: ``ImageGraphSpec``, the request limits and defaults of an image graph;
- ``frontend``: ``ImageRequestChecks`` (size, steps, guidance, cache checks), ``collect_images`` and
  ``image_response`` (stage outputs -> the OpenAI images response);
- ``replica``: the per-request programs (``TextEncodeProgram``, ``DenoiseProgram``, ``DecodeProgram``), the
  batched computations, the cache-dit sessions and the stage runners (stage replicas only).
"""

"""The benchmarks of each model family, outside the runtime package: ``benchmarks/<family>/`` holds the family's bench
plug-in (``BENCH``, found by ``omni_serve.bench.plugins`` by the family's name), its in-process baselines, its
compute-ceiling script, its graph values and its run recipes (``run*.sh``); ``tools/`` holds what several families'
scripts share (the server launcher, the ceiling report, soak and kernel timings). The modes shared by several
families live beside them (``omni_modes``, ``image_mode``, ``diffusers_image``).
"""

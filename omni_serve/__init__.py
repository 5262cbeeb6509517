"""omni_serve: any-to-any multimodal models served as Ray Serve stage graphs."""

__version__ = "0.1.0"

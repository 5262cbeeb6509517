"""Random-weight checkpoint writers (one module per model); ``UNSERVED_WRITERS`` lists those of models whose
graph is not served yet (``omni-serve make-checkpoint`` offers them too; a served family names its writer in its
``FAMILY`` instead, and its entry moves there)."""

UNSERVED_WRITERS: dict[str, str] = {}

"""Random-weight checkpoint writers (one module per model); ``UNSERVED_WRITERS`` lists those of models whose
graph is not served yet (``omni-serve make-checkpoint`` offers them too; a served family names its writer in its
``FAMILY`` instead, and its entry moves there)."""

import json
import os

UNSERVED_WRITERS: dict[str, str] = {
}


def write_marker(out_dir: str, family: str, size: str, seed: int) -> None:
    """``omni_serve_checkpoint.json``, written last: what wrote the directory (and that it is complete)."""
    with open(os.path.join(out_dir, "omni_serve_checkpoint.json"), "w") as f:
        json.dump({"family": family, "size": size, "seed": seed}, f, indent=2)

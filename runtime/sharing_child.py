"""The child process of a weight-cache trial compile (runtime/sharing_trial.py): `python -m
pocketdiff.runtime.sharing_child SPEC`, SPEC a JSON object {path, options, library, library_path}. It loads that LiteRT
library (the parent's: runtime/litert_c.py), compiles the model once on the GPU with the options (writing the
accelerator's cache files where they say) and frees it; exit status 0 when that worked. An abort inside the library
ends it by a signal, which is what the parent looks for. No core file is written."""
from __future__ import annotations

import json
import os
import resource
import sys


def main(spec: dict) -> int:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # an abort here is expected: no core file
    from .delegate import prepare_in_process
    from .litert_c import SINGLE_BUILD, SINGLE_BUILD_ENV, CompiledModel, Environment, LiteRtLibrary

    if spec["library"] == SINGLE_BUILD:
        os.environ[SINGLE_BUILD_ENV] = spec["library_path"]  # the parent's very file
    prepare_in_process()
    env = Environment(LiteRtLibrary.shared(spec["library"]))
    model = CompiledModel(spec["path"], env, spec["options"])
    model.close()
    env.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))

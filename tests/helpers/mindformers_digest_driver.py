"""Loads checkpoints with MindFormers' own load_checkpoint and records them with the patched trainer's code.

Started by tests/test_mindformers_load_digest.py in a subprocess whose PYTHONPATH starts with an
unpacked MindFormers wheel and the ``hyper_parallel`` stand-in. For each case of the job: the
pynative GPTModel built from the YAML's model section (as tests/helpers/mindformers_driver.py builds it),
``mindformers.checkpoint.checkpoint.load_checkpoint`` of the case's checkpoint into it (weights only,
as the align run loads), then ``Trainer._crossalign_write_load_digest`` of the trainer.py the
mindformers-load-digest patch was applied to, with CROSSALIGN_LOAD_DIGEST_DIR set to the case's
folder. (A whole Trainer.train() needs NPU kernels; the method is called on a stand-in whose
``model`` is the list of stages, as 2.0.0's trainer holds it.)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mindformers_driver import _log_to, _unlog, build, patched_trainer  # noqa: E402


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    from mindformers.checkpoint.checkpoint import load_checkpoint

    patched = patched_trainer(job["trainer"])
    model = yaml.safe_load(Path(job["yaml"]).read_text())["model"]
    written = {}
    for name, case in job["cases"].items():
        log = Path(case["folder"]).with_suffix(".log")
        net = build(model, log)
        handler = _log_to(log)
        try:
            load_checkpoint(case["checkpoint"], net)
        finally:
            _unlog(handler)
        os.environ["CROSSALIGN_LOAD_DIGEST_DIR"] = case["folder"]
        written[name] = patched.Trainer._crossalign_write_load_digest(SimpleNamespace(model=[net]),
                                                                      case["checkpoint"])
    Path(job["result"]).write_text(json.dumps(written))


if __name__ == "__main__":
    main()

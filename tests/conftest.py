import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)
# commands run eager here (subprocesses inherit this): compiling each tiny random model would cost each test half a
# minute; the compiled step has tests of its own (test_compiled_step.py), which turn it on themselves
os.environ["EYAS_ENFORCE_EAGER"] = "1"

# Fixtures more than one test module uses. Module-scoped: each module gets its own, as when it defined them; a module
# that defines a fixture of the same name (test_checkpoint's `checkpoint`, test_ttt's `target`) uses its own.


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    """The tiny random target (tiny.BASE) the EAGLE-3 drafts in tiny.py are written for."""
    from tiny import make_hf_checkpoint

    path = tmp_path_factory.mktemp("target")
    make_hf_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def target(target_path):
    from eyas import load_model

    return load_model(target_path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random target with the shipped tokenizer (and its chat template) and an MTP layer."""
    from tiny import make_served_checkpoint

    return make_served_checkpoint(tmp_path_factory.mktemp("serve_ckpt"))

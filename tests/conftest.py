import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("DRAFTSMITH_TEST_THREADS", "2")))
# Decoders in CLI and pipeline tests use our forward eagerly: compiling (the default) costs a minute per graph.
# The compiled path has its own tests (test_fastpath.py, the compiled half of test_decoder_enumeration.py).
os.environ.setdefault("DRAFTSMITH_FORWARD", "fast")


@pytest.fixture()
def tiny_target():
    from tests.tiny import make_tiny_target
    return make_tiny_target()


@pytest.fixture(scope="session")
def real_target():
    """The real default target (SmolLM2-135M-Instruct), converted once and cached."""
    from draftsmith.target import load_target
    return load_target()

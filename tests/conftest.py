import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("DRAFTSMITH_TEST_THREADS", "2")))
# Decoders in CLI and pipeline tests use our forward eagerly: compiling (the default) costs a minute per graph.
# The compiled path has its own tests (test_fastpath.py, the compiled half of test_decoder_enumeration.py).
os.environ.setdefault("DRAFTSMITH_FORWARD", "fast")
# Compiled 1-row graphs keep inductor's Python wrapper here (the C++ one adds most of a minute to each compile);
# tests/test_fastpath.py checks that the C++ wrapper gives the same bits.
os.environ.setdefault("DRAFTSMITH_CPP_WRAPPER", "0")


@pytest.fixture()
def tiny_target():
    from tests.tiny import make_tiny_target
    return make_tiny_target()


@pytest.fixture(scope="session")
def real_target():
    """The real default target (SmolLM2-135M-Instruct), converted once and cached."""
    from draftsmith.target import load_target
    return load_target()

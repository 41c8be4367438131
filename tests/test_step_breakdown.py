"""The step breakdown's forward clock."""

import torch


def test_forward_clock_times_outermost_forwards_and_restores_the_patch():
    from draftsmith.engine.decoder import SpeculativeDecoder
    from draftsmith.drafters.standalone.decode import first_layers_drafter
    from draftsmith.engine.sampling import TorchRandom
    from benchmarks.step_breakdown import ForwardClock
    from tests.tiny import make_tiny_target

    call = torch.nn.Module.__call__
    tgt = make_tiny_target(seed=1)
    dec = SpeculativeDecoder(tgt, first_layers_drafter(tgt, 1))
    state, rng = dec.start([1, 2, 3, 4], 12), TorchRandom(0)
    with ForwardClock() as clock:
        while not state.done:
            dec.step(state, rng)
    steps = sum(s.draft_s + s.verify_s + s.other_s for s in state.steps)
    assert 0 < clock.seconds <= steps * 1.01 + 1e-3
    assert torch.nn.Module.__call__ is call  # uninstalled on exit

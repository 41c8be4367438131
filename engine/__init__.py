"""The decoding engine: the one lossless speculative decoder and everything it is made of.

Used by eval (benchmarks, checks), export, the server and the online job; it imports only the core
(target, checkpoint, registry) and finds drafter kinds through their checkpoints, never by name.

Public surface:
- ``decoder.SpeculativeDecoder``: prefill, draft, verify, commit (chains, static and dynamic trees);
- ``batched.BatchedSpeculativeDecoder``: B rows at once with ragged acceptance (``kvcache.KVCache``), plain
  batched decoding, and the batch-aware draft length (``batch_policy``: SmartSpec-style goodput by batch size);
- ``drafters``: the drafter interface (the kinds' drafters live in their folders: heads/decode.py,
  drafters/standalone/decode.py, ...); ``capabilities``: what a drafter can do, read and checked in one place;
- ``trees``, ``tree_build``: draft trees and building them from measured acceptance and step cost;
- ``sampling``: processed distributions and exact verification; ``policies``: draft-length policies;
- ``kvcache``: the pre-allocated slot cache; ``cpu_layout``: the CPU decoding weight layout;
- ``metrics``: the one definition of tau, acceptance by position, speedup.
"""

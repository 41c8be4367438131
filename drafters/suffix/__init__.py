"""Model-free drafting from traffic: SuffixDecoding and prompt lookup (no trainable module).

Not a registered kind: there is nothing to train, and its "checkpoint" is
an index configuration (`SuffixConfig`) plus, optionally, a saved global
index (`SuffixIndex.save` / `load`). It is a decoder-side drafter, chosen
with ``--suffix`` (docs/DECISIONS.md).
"""

from draftsmith.drafters.suffix.drafter import Calibration, HybridDrafter, PromptLookupDrafter, SuffixDrafter
from draftsmith.drafters.suffix.index import Draft, SuffixConfig, SuffixIndex, TokenIndex

__all__ = ["Calibration", "Draft", "HybridDrafter", "PromptLookupDrafter", "SuffixConfig", "SuffixDrafter",
           "SuffixIndex", "TokenIndex"]

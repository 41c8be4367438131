"""draftsmith: train, distill and ship speculative-decoding drafters.

The top-level package is the small core shared by every drafter kind:
target loading and fingerprints (`draftsmith.target`), the checkpoint format
(`draftsmith.checkpoint`), the recipe schema (`draftsmith.recipe`), the
drafter-kind registry (`draftsmith.registry`) and the CLI (`draftsmith.cli`).
"""

__version__ = "0.1.0"

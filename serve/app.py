"""The reference OpenAI-compatible server, in four parts read top to bottom:

  * `draftsmith.serve.routes`: the HTTP side (routes, streaming, API key, body limit, 429, disconnects);
  * `draftsmith.serve.service`: `DecodingService`, the target, the published drafter, decoding and the log;
  * `draftsmith.serve.scheduler`: the bounded queue and the batching thread (continuous batching);
  * `draftsmith.serve.suffix_state`: SuffixDecoding's global index (start, learn, save).

This module names the two entry points: ``create_app(DecodingService(target, ...))``.
"""

from draftsmith.serve.routes import create_app
from draftsmith.serve.service import DecodingService

__all__ = ["DecodingService", "create_app"]

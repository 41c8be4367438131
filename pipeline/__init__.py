"""The pipeline's stages (data, cache, train, trees, report, bench), each a function a recipe runs, with its
budget, outputs and report; `draftsmith run` and `draftsmith quickstart` (draftsmith.cli) call them in order."""

"""draftsmith.serve: the reference OpenAI-compatible server that decodes losslessly and logs its traffic."""

"""draftsmith.recipes."""

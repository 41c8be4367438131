"""draftsmith.tests."""

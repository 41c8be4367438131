"""draftsmith.classifiers."""

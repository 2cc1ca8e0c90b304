"""Errors that are the user's to fix: lab.py prints the message on one line and exits 2."""


class LabError(Exception):
    """A bad argument or a missing resource, with a message that says what to do."""


class CheckpointError(LabError):
    """A checkpoint that is missing, unreadable, or not of the model's shape (the message names the tensor)."""


class ModelSourceError(LabError):
    """A hub model that can be neither found in the cache nor downloaded."""

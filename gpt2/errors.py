"""Errors that are the user's to fix: lab.py prints the message on one line and exits 2.
They are the lab's, shared with llama/ (lm/errors.py); gpt2.errors names them too."""

from lm.errors import CheckpointError, LabError, ModelSourceError

__all__ = ["CheckpointError", "LabError", "ModelSourceError"]

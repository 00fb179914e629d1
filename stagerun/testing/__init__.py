"""Public helpers for testing stagerun and its plugins without the real model."""

from ._tiny_model import write_tiny_model as write_tiny_model

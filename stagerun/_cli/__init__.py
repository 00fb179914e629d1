"""The command line: ``stagerun generate | stage | serve | bench | models | plugins``."""

from ._main import main as main

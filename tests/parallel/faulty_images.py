"""An image input that fails in a rank worker (a module of its own: the ranks unpickle it by import)."""

from __future__ import annotations

import os

from deepinfer.model.vision import ImageInput


class FailsOnTheRank(ImageInput):
    """An image whose patches cannot be read in any process but the one that made it (a rank worker
    unpickles it): its encode raises there, as a memory or driver fault would."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.made_in = os.getpid()

    def __getattribute__(self, name):
        if name == "patches" and object.__getattribute__(self, "__dict__").get("made_in") != os.getpid():
            raise RuntimeError("injected: the rank could not read this image")
        return super().__getattribute__(name)

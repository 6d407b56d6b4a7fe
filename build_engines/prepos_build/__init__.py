"""prepos_build: turn a checkpoint into a prepos engine directory.

Importing this package is cheap; torch and transformers are imported only when
an engine is actually built. The entry points are
``prepos_build.convert.convert`` and ``prepos_build.framing.derive_framing``.
"""

from .convert import BUILDER, ENGINE_FILE, FORMAT_VERSION, ConvertError, read_engine
from .framing import FramingError, derive_framing

__version__ = "0.1"

__all__ = [
    "BUILDER",
    "ENGINE_FILE",
    "FORMAT_VERSION",
    "ConvertError",
    "FramingError",
    "derive_framing",
    "read_engine",
]

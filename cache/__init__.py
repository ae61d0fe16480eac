"""The limit cache shared by every feature of the pack (imports nothing else from the pack)."""
from .fingerprint import fingerprint, fingerprint_id
from .paths import ENV_VAR, default_cache_path
from .store import KNOWN_NAMESPACES, SCHEMA_VERSION, CacheFormatError, LimitCache, register_shape
from .open import open_cache
from . import shapes  # noqa: F401,E402 - registers the shapes of the pack's namespaces

__all__ = ["LimitCache", "default_cache_path", "fingerprint", "fingerprint_id", "ENV_VAR", "SCHEMA_VERSION",
           "KNOWN_NAMESPACES", "CacheFormatError", "open_cache", "register_shape"]

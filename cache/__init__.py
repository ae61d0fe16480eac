"""The limit cache shared by every feature of the pack (imports nothing else from the pack)."""
from .fingerprint import fingerprint, fingerprint_id
from .paths import ENV_VAR, default_cache_path
from .entries import SCHEMA_VERSION, CacheFormatError, register_shape
from .store import KNOWN_NAMESPACES, LimitCache, count_entries
from .open import open_cache
from .shapes import memory_shape  # noqa: F401,E402 - importing shapes registers the namespaces' shapes

__all__ = ["LimitCache", "default_cache_path", "fingerprint", "fingerprint_id", "ENV_VAR", "SCHEMA_VERSION",
           "KNOWN_NAMESPACES", "CacheFormatError", "open_cache", "register_shape", "count_entries"]

"""The limit cache shared by every feature of the pack (imports nothing else from the pack)."""
from .fingerprint import fingerprint, fingerprint_id
from .paths import default_cache_path
from .entries import register_shape
from .store import KNOWN_NAMESPACES, LimitCache, count_entries
from .open import open_cache
from .shapes import memory_shape  # noqa: F401,E402 - importing shapes registers the namespaces' shapes

__all__ = ["LimitCache", "default_cache_path", "fingerprint", "fingerprint_id", "KNOWN_NAMESPACES", "open_cache",
           "register_shape", "count_entries"]

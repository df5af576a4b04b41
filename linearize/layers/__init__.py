"""The GDN attention module (a drop-in for a transformers attention module) and its cache state."""

from .cache import GDNStateLayer
from .gdn_attention import GDNAttention, GDNOptions

__all__ = ["GDNAttention", "GDNOptions", "GDNStateLayer"]

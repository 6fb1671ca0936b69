"""The torch.compile backend: capture attention sites, rewrite them, report (``backend.py`` is the entry)."""

from ultraattn.passes.backend import COUNTERS, RECORDS, backend, reset, ultraattn_backend
from ultraattn.passes.capture import Site, find_sites
from ultraattn.passes.options import BackendOptions, parse_options

__all__ = ["COUNTERS", "RECORDS", "BackendOptions", "Site", "backend", "find_sites", "parse_options", "reset",
           "ultraattn_backend"]

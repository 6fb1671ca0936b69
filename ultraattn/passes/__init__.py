"""The torch.compile backend: capture attention sites, rewrite them, report (``backend.py`` is the entry)."""

from ultraattn.passes.backend import COUNTERS, RECORDS, reset, ultraattn_backend
from ultraattn.passes.capture import Site, find_sites
from ultraattn.passes.options import BackendOptions, parse_options

# (the submodule ``ultraattn.passes.backend`` keeps its name: the callable is ``ultraattn.backend``)
__all__ = ["COUNTERS", "RECORDS", "BackendOptions", "Site", "find_sites", "parse_options", "reset", "ultraattn_backend"]

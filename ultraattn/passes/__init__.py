"""The compile backend's passes: capture, rewrite, sequence sharding, explicit per-rank programs.

``backend.py`` is the pipeline, top-down; ``state.py`` holds all process state (the side table);
``records.py`` is what a compile produced (the reports' input). The registered backend that runs
the pipeline and shows the reports is ``ultraattn.compiler.ultraattn_backend``.
"""

from ultraattn.passes.backend import compile_graph
from ultraattn.passes.capture import Site, find_sites
from ultraattn.passes.options import BackendOptions, parse_options
from ultraattn.passes.state import SideTable, private_side_table, reset, side_table

__all__ = ["BackendOptions", "SideTable", "Site", "compile_graph", "find_sites", "parse_options",
           "private_side_table", "reset", "side_table"]

"""The custom ops that rewritten graphs call, apart from the passes that insert them.

``site``: one attention site as one op (``site_attention[_local]`` and their backward ops);
``program``: the nodes of an explicit per-rank program (``cp_*``); ``seq``: moving data between
the global view and this rank's tokens (``sp_*``). Importing this package registers them all.
"""

from ultraattn.passes.ops import program, seq, site

__all__ = ["program", "seq", "site"]

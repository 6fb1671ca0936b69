"""The custom ops that rewritten graphs call, apart from the passes that insert them.

``site``: one attention site as one op (``site_attention[_local]`` and their backward ops);
``kept``: a kept flex_attention site run eagerly (CPU under Inductor);
``program``: the nodes of an explicit per-rank program (``cp_*``); ``per_mask``: those of a program whose mask
arrives at run time (``cp_mask_*``); ``seq``: moving data between the global view and this rank's tokens
(``sp_*``). Importing this package registers them all; what each op is: ``passes/opinfo.py``.
"""

from ultraattn.passes.ops import kept, per_mask, program, seq, site

__all__ = ["kept", "per_mask", "program", "seq", "site"]

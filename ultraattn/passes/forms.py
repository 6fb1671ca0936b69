"""What each attention site of a graph runs as: its ``SiteForm``, decided by ``form_for`` and nowhere else.

``capture.py`` says what a site *can* become (a site it cannot rewrite exactly carries the reason); this module
chooses among what it can become, once per site, from the site (op, mask, shapes, device), the world size and the
backend options. The backend records the decision on the ``Site`` and, for a rewritten site, in its
``SiteState``; the rewrite, the expansion, the sharding pass and the report read it there and never decide again.

The forms, in the order they are tried:

* ``KEPT_FLEX``: a flex site that cannot be rewritten, on the CPU, with constant arguments: made to run as the
  model wrote it (``kept.py``: eager flex applies the BlockMask's blocks as a GPU does).
* ``AS_WRITTEN``: the model's own call: a site that cannot be rewritten (replicated across ranks at world size
  > 1), or at world size 1 a site whose own op is faster than the tiles on this device (``world1`` option).
* ``ONE_OP``: the tiles inside one opaque op (``options['explicit']`` off, dynamic shapes, or world size 1 with a
  mask that arrives at run time: the kernel op runs with each mask's block lists).
* ``PROGRAM_PER_MASK``: this rank's program over a fixed skeleton, planned for each mask as it arrives.
* ``KERNEL``: world size 1 with a mask known at compile time: the block-sparse kernel op itself.
* ``PROGRAM``: this rank's tiles and messages, planned at compile time and expanded into the compiled graphs.
"""

from __future__ import annotations

from ultraattn.passes.capture import Site
from ultraattn.passes.kept import kept_flex_call
from ultraattn.passes.options import BackendOptions
from ultraattn.passes.records import SiteForm
from ultraattn.passes.site import STATIC_MASKS


def form_for(s: Site, opts: BackendOptions) -> tuple[SiteForm, str]:
    """What site ``s`` runs as, and why (the report's words). The one place a site's form is decided."""
    device = s.device.type if s.device is not None else None
    if not s.rewritable:
        if s.op == "flex" and device == "cpu" and kept_flex_call(s) is not None:
            return SiteForm.KEPT_FLEX, s.reason
        return SiteForm.AS_WRITTEN, s.reason
    world = opts.world_size
    if world == 1:
        kept = _world1_keeps_original(s, device, opts.world1)
        if kept:
            return SiteForm.AS_WRITTEN, f"kept ({kept})"
    if not opts.explicit:
        return SiteForm.ONE_OP, "options['explicit'] is False"
    if not all(isinstance(d, int) for d in (*s.q_shape, *s.kv_shape)):
        return SiteForm.ONE_OP, "dynamic shapes"
    if s.mask not in STATIC_MASKS:
        if world == 1:
            return SiteForm.ONE_OP, "world size 1 with a run-time mask: the block-sparse kernel op runs with each " \
                                    "mask's block lists"
        return SiteForm.PROGRAM_PER_MASK, "the mask arrives at run time"
    if world == 1:
        return SiteForm.KERNEL, "world size 1: nothing to split"
    return SiteForm.PROGRAM, "the plan is known at compile time"


def _world1_keeps_original(s: Site, device: str, choice: str) -> str:
    """Why a rewritable site at world size 1 keeps its own op ('' when the tiles run it).

    With no context to split, a site runs wherever it is faster. On a GPU, measured on an H100/H200 (docs/gpu.md,
    issue 52): the tiles run at 0.52-0.59x FlexAttention's forward+backward speed on every mask, and at 0.6x SDPA's
    flash kernel on causal attention, so a flex site, and an SDPA site that is causal or unmasked, keep the original
    op (Inductor lowers flex_attention to its own Triton template). An SDPA site with a boolean mask runs on the
    tiles: they skip the blocks the mask leaves empty, which SDPA computes (cuDNN on transformers' dense causal
    mask: 24.2 ms against the tiles' 18.6 ms at 8K, issue 51). On the CPU the tiles run (the reference path the
    tests check). ``choice``: the backend option ``world1`` (``auto``, ``tiles``, ``original``)."""
    if choice == "tiles" or (choice == "auto" and device != "cuda"):
        return ""
    if choice == "original":
        return "the world1 option"
    if s.op == "sdpa" and s.mask == "bool_mask":
        return ""
    return f"world size 1 on {device}: {'flex_attention' if s.op == 'flex' else 'SDPA'} is faster there than the " \
           f"tiles (docs/gpu.md)"

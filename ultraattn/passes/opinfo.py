"""What each ``ultraattn::`` op is, in one table: every classification the passes and the reports make reads it.

A new op gets one row here (the ops themselves live in ``passes/ops/`` and ``kernels/ops.py``). The flags:

* ``comm``: it communicates (reports highlight it; ``explicit/order.py`` puts it in the one order every rank runs);
* ``token``: its first argument is its program's communication token (the chain of a site's program);
* ``after``: it takes an ``after`` argument, its place in that order (an op outside a site's program);
* ``wait``: it ends a communication stage (its element 0 is the program's next token);
* ``tile``: it computes attention tiles (reports count and colour them);
* ``tile_row``: its last argument indexes its program's table of tile rows.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class OpInfo:
    comm: bool = False
    token: bool = False
    after: bool = False
    wait: bool = False
    tile: bool = False
    tile_row: bool = False


_COMM_TOKEN = OpInfo(comm=True, token=True)
_AFTER = OpInfo(comm=True, after=True)
_WAIT = OpInfo(comm=True, token=True, wait=True)

OPS: dict[str, OpInfo] = {
    # a site as one op (passes/ops/site.py) and the sequence ops (passes/ops/seq.py)
    "site_attention": _AFTER, "site_attention_bwd": _AFTER,
    "site_attention_local": _AFTER, "site_attention_local_bwd": _AFTER,
    "sp_gather": _AFTER, "sp_all_reduce": _AFTER, "sp_weight_grad": _AFTER,
    "sp_dispatch": OpInfo(), "sp_dispatch_grad": OpInfo(), "sp_valid": OpInfo(),
    "int_tensor": OpInfo(), "float_tensor": OpInfo(), "mask_block_kinds": OpInfo(),
    # a site's explicit program (passes/ops/program.py): its plan traced at compile time, or run-time data
    "cp_start": _COMM_TOKEN, "cp_wait": _WAIT, "cp_finish": _COMM_TOKEN, "cp_gather": _COMM_TOKEN,
    "cp_check_inputs": _COMM_TOKEN, "cp_all_reduce": _COMM_TOKEN,
    "cp_stash": OpInfo(token=True), "cp_unstash": OpInfo(), "cp_token": OpInfo(),
    "cp_tile_lists": OpInfo(tile_row=True), "cp_block_lists": OpInfo(),
    "cp_tiles_fwd": OpInfo(tile=True, tile_row=True), "cp_tiles_bwd": OpInfo(tile=True, tile_row=True),
    # a site's explicit program for masks that arrive at run time (passes/ops/per_mask.py)
    # (its stages, gathers and stash are the ops above, with the plan as data)
    "cp_mask_plan": _COMM_TOKEN, "cp_mask_index": OpInfo(),
    # kernels (kernels/ops.py) and kept flex_attention sites (passes/ops/kept.py)
    "bsa_fwd": OpInfo(tile=True), "bsa_bwd": OpInfo(tile=True),
    "bsa_fwd_ref": OpInfo(), "bsa_bwd_ref": OpInfo(), "kept_flex": OpInfo(), "kept_flex_bwd": OpInfo(),
}


def ops_where(flag: str) -> frozenset[str]:
    """The names of the ops with ``flag`` set."""
    return frozenset(name for name, info in OPS.items() if getattr(info, flag))


COMM_OPS = ops_where("comm")
TOKEN_OPS = ops_where("token")
AFTER_OPS = ops_where("after")
WAIT_OPS = ops_where("wait")
TILE_OPS = ops_where("tile")
TILE_ROW_OPS = ops_where("tile_row")


@functools.cache
def ops_digest() -> str:
    """A digest of what the ops are in this install: every op's schema and the source of the modules that define
    the ops and their fake implementations. Site keys carry it (``SideTable.site_key``), so a graph compiled by
    another version of ultraattn never comes back from Inductor's or AOTAutograd's on-disk cache calling ops whose
    signature or meaning has changed since. (Called once the ops are registered: a site key is taken after.)"""
    import torch

    here = Path(__file__).parent
    h = hashlib.sha1()
    for name in sorted(OPS):
        h.update(str(getattr(torch.ops.ultraattn, name).default._schema).encode())
    for f in [here.parent / "kernels" / "ops.py", *sorted((here / "ops").glob("*.py"))]:
        h.update(f.read_bytes())
    return h.hexdigest()[:12]

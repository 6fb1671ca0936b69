"""Explicit per-rank programs: sites with a compile-time plan, expanded in the graphs AOT autograd makes.

``program.py``: a site's program (its stage and tile tables, the IO that emits its ops, the traced
forward and backward); ``expand.py``: the pass that splices programs in; ``order.py``: the pass
that puts every communicating node in one order on every rank.
"""

from ultraattn.passes.explicit.expand import expand_sites, prepare, schedule_rows
from ultraattn.passes.explicit.order import order_comm

__all__ = ["expand_sites", "order_comm", "prepare", "schedule_rows"]

"""Analysis of the sequence-sharding pass: alignment (which dim carries the sequence) and the sharded region.

Pure: it reads the graph and returns an ``Analysis``; nothing is rewritten and nothing
communicates (``lowering.py`` rewrites; the backend plans the layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ultraattn.passes.fx_util import is_tensor_node, meta_value
from ultraattn.passes.records import Fallback, ShardSummary
from ultraattn.passes.shard.links import (
    TARGET,
    Link,
    Seq,
    Specs,
    arg,
    ndim_of,
    opname,
    shape_of,
    tensor_inputs,
    tuple_inputs,
)
from ultraattn.passes.shard.rules import Rule
from ultraattn.passes.shard.table import is_inplace, rule_for


@dataclass
class Analysis:
    """What the pass decided for one graph (plain data for reports and tests)."""

    specs: Specs
    mode: dict[fx.Node, str]
    """Nodes in the region -> 'shard' | 'reduce'."""
    seq_len: int
    sites: list[fx.Node]
    skipped_sites: dict[str, str] = field(default_factory=dict)
    """site node name -> why it stays a global-view op."""
    carried: dict[fx.Node, Seq] = field(default_factory=dict)
    """Placeholders that arrive as this rank's shard and are taken as they are (in the region, mode 'shard')."""


def site_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    op = torch.ops.ultraattn.site_attention.default
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]


def align(gm: fx.GraphModule, seeds: dict[fx.Node, Seq]) -> tuple[Specs, dict[fx.Node, list[Link]]]:
    """Sequence specs of every value, from the seeds, by the rules' links (fixpoint, both directions)."""
    sp = Specs(max(s.length for s in seeds.values()) if seeds else None)
    for n, s in seeds.items():
        sp.set(n, s)
    links: dict[fx.Node, list[Link]] = {}
    for n in gm.graph.nodes:
        r = rule_for(n) if n.op in ("call_function", "call_method") else None
        if r is None:
            continue
        try:
            links[n] = r.links(n)
        except Exception:  # noqa: BLE001 - an op whose arguments the rule does not understand: no links
            links[n] = []
    for _ in range(100):
        sp.changed = False
        for n, lks in links.items():
            for lk in lks:
                if lk.out_index == TARGET:  # (a loss) input <-> target: the target node carries it
                    t = arg(n, 1, "target")
                    a, b = sp.seq(lk.inp), sp.seq(t)
                    if a is not None:
                        sp.set(t, lk.fwd(a))
                    if b is not None:
                        sp.set(lk.inp, lk.bwd(b))
                    continue
                a = sp.seq(lk.inp, lk.in_index)
                b = sp.seq(n, lk.out_index)
                if a is not None:
                    sp.set(n, lk.fwd(a), lk.out_index)
                if b is not None:
                    sp.set(lk.inp, lk.bwd(b), lk.in_index)
        if not sp.changed:
            break
    return sp, links


def choose_region(gm: fx.GraphModule, sp: Specs, sites: list[fx.Node],
                  carried: dict[fx.Node, Seq] | None = None) -> dict[fx.Node, str]:
    """The nodes that run on local tokens (see the module docstring), each with its mode; ``carried``
    placeholders (already local) start in it."""
    modes: dict[fx.Node, str | None] = {}
    rules: dict[fx.Node, Rule] = {}
    for n in gm.graph.nodes:
        r = rule_for(n) if n.op in ("call_function", "call_method") else None
        if r is None:
            continue
        rules[n] = r
        try:
            modes[n] = r.mode(n, sp)
        except Exception:  # noqa: BLE001 - arguments the rule does not understand: replicated
            modes[n] = None
    region: dict[fx.Node, str] = {n: "shard" for n in sites if modes.get(n) == "shard"}
    region.update((ph, "shard") for ph in carried or {})
    nodes = list(gm.graph.nodes)
    pinned: set[fx.Node] = set()
    for n in nodes:  # an in-place op that cannot run sharded keeps the tensor it modifies replicated
        if n in rules and is_inplace(n) and modes.get(n) is None and n.args and isinstance(n.args[0], fx.Node):
            pinned.add(n.args[0])

    def takes_sharded(user: fx.Node, m: fx.Node) -> bool:
        if user.op == "output":
            return True
        if user not in region:
            return False
        r = rules[user]
        if m in r.meta_args(user):
            return True
        if m in r.rep_args(user):
            return False
        if region[user] == "reduce":
            return True
        return any(lk.inp is m for lk in r.links(user))

    def is_tuple(n: fx.Node) -> bool:
        return isinstance(meta_value(n), tuple | list)

    def element_ok(gi: fx.Node) -> bool:
        """A getitem of a tuple can join with its producer: it runs sharded and its consumers take it so."""
        return modes.get(gi) == "shard" and all(takes_sharded(u, gi) or u in region for u in gi.users)

    changed = True
    while changed:
        changed = False
        for n in nodes:  # forwards: consumers of the region
            mode = modes.get(n)
            if n in region or mode is None or n in pinned:
                continue
            r = rules[n]
            if any(m in region and m not in r.rep_args(n) for m in tensor_inputs(n) + tuple_inputs(n)):
                if is_inplace(n) and n.args[0] not in region:
                    continue
                if opname(n) == "getitem" and is_tuple(n.args[0]) and n.args[0] not in region:
                    continue
                region[n] = mode
                changed = True
        for n in reversed(nodes):  # backwards: producers whose every consumer takes them sharded
            if n in region or modes.get(n) != "shard" or n in pinned:
                continue
            if opname(n) == "getitem" and is_tuple(n.args[0]):
                continue  # joins with its tuple's producer
            users = list(n.users)
            if is_tuple(n):
                if users and all(opname(u) == "getitem" and element_ok(u) for u in users) and \
                        any(any(v in region for v in u.users) for u in users):
                    region[n] = "shard"
                    for u in users:
                        region.setdefault(u, "shard")
                    changed = True
                continue
            if not users or not any(u in region for u in users):
                continue
            if all(takes_sharded(u, n) for u in users):
                region[n] = "shard"
                changed = True
    return region


def analyse(gm: fx.GraphModule, carried: dict[fx.Node, Seq] | None = None) -> Analysis | None:
    """Alignment and region of ``gm`` (None: nothing to shard around: no site and no carried input).

    ``carried``: placeholders whose values arrive as this rank's shard (``passes/carrier.py``), with the dim that
    carries the sequence; those the analysis aligns the same way join the region (``Analysis.carried``). A graph
    without attention (a model's head and loss compiled on their own) is sharded around them alone."""
    sites = site_nodes(gm)
    if not sites and not carried:
        return None
    S = shape_of(sites[0].args[0])[2] if sites else next(iter(carried.values())).length
    seeds = {ph: s for ph, s in (carried or {}).items() if s.length == S}
    use = []
    skipped = {}
    for n in sites:
        q, k, v = n.args[:3]
        if not all(is_tensor_node(m) and ndim_of(m) == 4 for m in (q, k, v)) or \
                any(shape_of(m)[2] != S for m in (q, k, v)):
            skipped[n.name] = f"sequence length differs from the graph's first attention ({S})"
            continue
        for m in (q, k, v):
            seeds[m] = Seq(2, S, 1)
        use.append(n)
    sp, _links = align(gm, seeds)
    for n in use:
        for o in (0, 1):
            sp.set(n, Seq(2, S, 1), o)
    taken = {ph: s for ph, s in (carried or {}).items() if s.length == S and sp.seq(ph) == s}
    region = choose_region(gm, sp, use, taken)
    for n in use:
        if n not in region:
            skipped[n.name] = "its q, k or v is aligned with the sequence in two ways (a conflicting op)"
    return Analysis(specs=sp, mode=region, seq_len=S, sites=use, skipped_sites=skipped, carried=taken)


def why_gathered(user: fx.Node) -> str:
    """Why ``user`` (outside the region) needs the global value of a sharded input."""
    name = opname(user)
    if user.op == "output":
        return "graph output"
    if name is None:
        return f"{user.op} {getattr(user.target, '__name__', user.target)} is not a torch op the pass knows"
    if rule_for(user) is None:
        return f"no sharding rule for {name}"
    return f"{name} is not token-wise along the sequence here"


def summarize(gm: fx.GraphModule, an: Analysis) -> ShardSummary:
    """What lowering would do, from the analysis alone (``ultraattn.explain``: no process group, no layout)."""
    local = {n for n, m in an.mode.items() if m == "shard" and n.op != "placeholder"}
    fallbacks = []
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method") and n not in an.mode and opname(n) not in ("size", "dim", "numel"):
            fallbacks += [Fallback(node=m.name, op=opname(n) or str(n.target), why=why_gathered(n), bytes=0)
                          for m in n.all_input_nodes if m in local]
    return ShardSummary(layout="", seq_len=an.seq_len, local_len=0, sharded_ops=len(local),
                        reductions=sum(m == "reduce" for m in an.mode.values()), fallbacks=tuple(fallbacks),
                        skipped_sites=tuple(an.skipped_sites.items()), planned_only=True)

"""One rank of tests/test_clean_exit.py, run as its own program: many mixed plans through ultraattn's public runtime
API, then destroy_process_group() and a normal interpreter exit (the exit status is what the test checks).

    python tests/clean_exit_rank.py RANK WORLD PORT PLANS

Plans mix the fast planner on BlockMasks (new documents every step, some handed to ``plan_ahead`` so its worker
thread is alive at exit), the ILP planner on a mask_mod and every baseline, each run forward and backward. The
first BlockMask imports torch._dynamo, after init_process_group, as in a training script: that is what left the
WORLD group referenced past destroy_process_group() (``ultraattn/runtime/comm.py``, [Note: destroyed groups at
exit]). At exit, after ultraattn's exit handler, this program checks that the group was freed; if not it exits
with status 3 (deterministic, where the abort it prevents happens only in some runs).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import json
import os
import sys
import weakref

import torch
import torch.distributed as dist

_WORLD_GROUP: list = []
#: the last step's tensors, kept to the end like a training script's module-level variables: they are freed while
#: the interpreter shuts down, which is when a gloo worker still holding them needs the GIL
LAST: dict = {}


def _group_freed_at_exit() -> None:
    """Registered before ultraattn's handlers, so it runs after them (atexit is last in, first out)."""
    if _WORLD_GROUP:
        gc.collect()
        if _WORLD_GROUP[0]() is not None:
            sys.stderr.write("clean_exit_rank: the destroyed WORLD process group is still alive at exit\n")
            sys.stderr.flush()
            os._exit(3)


def main(rank: int, world: int, port: int, plans: int) -> dict:
    atexit.register(_group_freed_at_exit)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    from torch.nn.attention.flex_attention import create_block_mask

    import ultraattn
    from ultraattn.planner.tiling import PlannerOptions
    from ultraattn.runtime.comm import release_destroyed_groups

    opts = PlannerOptions(time_budget=1.0, ilp_time_limit=0.5, schedule_time_limit=0.3, heuristic_seconds=0.1)
    g = torch.Generator().manual_seed(0)  # the same on every rank: every rank plans the same masks
    s, h, d = 192, 4, 16
    methods = ("ring", "zigzag", "allgather", "ulysses", "usp")
    counts: dict[str, int] = {}
    for n in range(plans):
        cuts = sorted(torch.randint(1, s, (3,), generator=g).tolist())
        doc = torch.bucketize(torch.arange(s), torch.tensor(cuts), right=True)

        def documents(b, hh, q, kv, doc=doc):
            return (doc[q] == doc[kv]) & (q >= kv)

        if n % 25 == 7:  # an ILP plan now and then (seconds each)
            kind, mask, kw = "ilp", documents, {"planner": "ilp", "options": opts}
        elif n % 5 == 4:
            kind, mask, kw = methods[n // 5 % 5], "causal", {"method": methods[n // 5 % 5]}
        else:
            mask = create_block_mask(documents, None, None, s, s, device="cpu", BLOCK_SIZE=32)
            kind, kw = "fast", {"planner": "fast"}
            if n % 3 == 0:
                ultraattn.plan_ahead(mask)
        plan = ultraattn.plan_attention(mask, seqlen=s, num_heads=h, head_dim=d, dtype=torch.float32, block_size=32,
                                        timeout=60, **kw)
        q, k, v = (torch.randn(1, h, s, d, generator=g).requires_grad_() for _ in range(3))
        o, lse = ultraattn.dist_attention(*(ultraattn.dispatch(x, plan) for x in (q, k, v)), plan)
        out = ultraattn.undispatch(o, plan)
        (out.sum() + ultraattn.undispatch(lse, plan).sum()).backward()
        grads = [x.grad for x in (q, k, v)]
        for gr in grads:  # each rank holds its own tokens' gradients: the sum is the whole gradient
            dist.all_reduce(gr)
        assert torch.isfinite(out).all() and all(torch.isfinite(gr).all() for gr in grads), n
        LAST.update(out=out, grads=grads)
        counts[kind] = counts.get(kind, 0) + 1
    # the exit handler is narrow: nothing is touched while the group is registered
    live_untouched = release_destroyed_groups() == 0
    _WORLD_GROUP.append(weakref.ref(dist.group.WORLD))
    dist.destroy_process_group()
    try:  # a plan outliving its group says so (ultraattn holds the group weakly: it was freed)
        plan.group  # noqa: B018
        stale = "no error"
    except RuntimeError as exc:
        stale = str(exc)
    return {"stale_plan": stale, "rank": rank, "plans": plans, "kinds": counts, "live_untouched": live_untouched,
            "functional_imported": "torch.distributed.nn.functional" in sys.modules}


if __name__ == "__main__":
    r, w, p, n = (int(x) for x in sys.argv[1:5])
    print(json.dumps(main(r, w, p, n)), flush=True)

"""Runtime pieces that need no process group: LSE merge, programs, packing, input errors."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import ultraattn
from ultraattn.masks import generate_sliding_window, pattern_from_mask_mod
from ultraattn.planner.api import baseline_plan
from ultraattn.planner.plan import AttnShape, Kernel, Mesh, TilePlan, Transfer
from ultraattn.runtime.comm import pack, spec_bytes, unpack
from ultraattn.runtime.executor import PlanExecutionError, build_program
from ultraattn.runtime.tiles import merge_partial


def _partial(scores: torch.Tensor, v: torch.Tensor):
    lse = torch.logsumexp(scores, -1)
    p = torch.softmax(scores, -1).nan_to_num(0.0)
    return p @ v, lse


def test_merge_equals_one_softmax_over_the_union():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 5, 40, generator=g, dtype=torch.float64) * 30  # large logits: exp would overflow
    v = torch.randn(3, 40, 7, generator=g, dtype=torch.float64)
    whole = _partial(s, v)
    a = _partial(s[..., :13], v[:, :13])
    b = _partial(s[..., 13:], v[:, 13:])
    o, lse = merge_partial(a, b)
    assert torch.allclose(o, whole[0], atol=1e-12) and torch.allclose(lse, whole[1], atol=1e-12)


def test_merge_of_empty_rows_stays_finite():
    o = torch.zeros(2, 4, 3)
    lse = torch.full((2, 4), -math.inf)
    lse_b = lse.clone()
    lse_b[0, 1] = 0.5
    o_b = o.clone()
    o_b[0, 1] = 1.0
    mo, ml = merge_partial((o, lse), (o_b, lse_b))
    assert not torch.isnan(mo).any() and not torch.isnan(ml).any()
    assert ml[0, 1] == 0.5 and torch.equal(mo[0, 1], torch.ones(3))
    assert torch.isinf(ml[1]).all() and (mo[1] == 0).all()


def test_full_columns_of_a_masked_tile_run_unmasked():
    """``TileGeometry.pieces``: a tile that needs the mask for some of its columns runs its all-FULL columns (inside
    the sequence) as their own unmasked piece; every column of the tile is in exactly one piece of the same rows, and
    a column past the sequence's end or with a PARTIAL block stays masked."""
    from ultraattn.masks.pattern import EMPTY, FULL, PARTIAL
    from ultraattn.runtime.tiles import TileGeometry

    b, nb = 32, 8   # one row chunk of 4 blocks; KV chunks 1 (blocks 4-7)
    kinds = torch.full((nb, nb), EMPTY, dtype=torch.int8)
    kinds[:4, 4:7] = FULL
    kinds[:4, 7] = PARTIAL
    kinds[2, 5] = PARTIAL   # column 5 is not FULL in every row of the tile

    def pieces(seq_len):
        geo = TileGeometry(seq_len=seq_len, chunk=4 * b, q_block=b, kv_block=b, batch=1, num_heads=1,
                           num_kv_heads=1, head_groups=1, head_dim=8, kind_gQK=[kinds], element=None)
        kv_ids = torch.arange(4, 8)
        return [(a, z, kv_ids[sel].tolist(), need) for a, z, sel, need in geo.pieces(0, 0, kv_ids)]

    got = pieces(nb * b)
    assert sorted(c for *_, cols, _ in got for c in cols) == [4, 5, 6, 7]
    assert {(a, z) for a, z, *_ in got} == {(0, 4)}
    assert sorted((cols, need) for *_, cols, need in got) == [([4, 6], False), ([5, 7], True)]
    # the last KV block runs past a sequence that ends inside it: masked even where its blocks are FULL
    kinds[:4, 7] = FULL
    assert sorted((cols, need) for *_, cols, need in pieces(nb * b - 5)) == [([4, 6], False), ([5, 7], True)]
    kinds[:4, 5] = FULL   # nothing needs the mask: one unmasked piece
    assert pieces(nb * b) == [(0, 4, [4, 5, 6, 7], False)]


def test_pack_roundtrip_and_sizes():
    a = torch.randn(2, 3, 4).to(torch.bfloat16)
    b = torch.randn(2, 3)
    spec = [((2, 3, 4), torch.bfloat16), ((2, 3), torch.float32)]
    buf = pack([a, b])
    assert buf.dtype == torch.uint8 and buf.numel() == spec_bytes(spec) == 2 * 3 * 4 * 2 + 2 * 3 * 4
    a2, b2 = unpack(buf, spec)
    assert torch.equal(a2, a) and torch.equal(b2, b)
    with pytest.raises(RuntimeError, match="does not match"):
        unpack(buf[:-1], spec)


def _shape():
    return AttnShape(seq_len=256, num_heads=4, head_dim=16, dtype="fp32")


def _units_needed(plan, step, phase):
    """The (tensor, chunk, group) units a program step needs from elsewhere: a launch its rows' and columns' inputs,
    a post its sends' payloads."""
    from ultraattn.planner.program import Launch
    from ultraattn.planner.schedule import PARTIAL_OF_FINAL

    if isinstance(step, Launch):
        rows = ("q",) if phase == "fwd" else ("qdo", "do")
        return ({(tn, i, g) for g, i, _ in step.rows for tn in rows}
                | {("kv", j, g) for g, _, js in step.rows for j in js})
    return {(PARTIAL_OF_FINAL.get(t.tensor, t.tensor), t.chunk, t.head_group) for _, t in step.sends}


def test_ring_program_relays_on_arrival_and_waits_only_for_what_it_needs():
    """A ring's K/V unit leaves a relay as soon as it lands there, and every wait is for a message the next step
    needs (no level-wide waits): the executor's program (``planner.program.rank_program``)."""
    from ultraattn.planner.program import Post, Wait
    from ultraattn.planner.schedule import PARTIAL_OF_FINAL

    pat = pattern_from_mask_mod(generate_sliding_window(256, causal=False), 256, block_size=32)
    plan = baseline_plan("ring", pat, _shape(), Mesh(nodes=1, devices=4))
    for r in range(4):
        for phase in ("fwd", "bwd"):
            steps = build_program(plan, r).steps[phase]
            posts = {n: s for n, s in enumerate(steps) if isinstance(s, Post)}
            for n, s in enumerate(steps):
                if not isinstance(s, Wait):
                    continue
                nxt = next((x for x in steps[n + 1:] if not isinstance(x, Wait)), None)
                got = {(PARTIAL_OF_FINAL.get(t.tensor, t.tensor), t.chunk, t.head_group)
                       for _, t in posts[s.post].recvs}
                if nxt is not None and posts[s.post].recvs:
                    assert got & _units_needed(plan, nxt, phase), (r, phase, n, steps)
    # rank 1 relays chunk 0's K/V (0 -> 1 -> 2) right after it lands: the wait, then the post that sends it on
    steps = build_program(plan, 1).steps["fwd"]
    wait_at = next(n for n, s in enumerate(steps) if isinstance(s, Wait)
                   and any(t.chunk == 0 and t.tensor == "kv" for _, t in steps[s.post].recvs))
    send_at = next(n for n, s in enumerate(steps) if isinstance(s, Post)
                   and any(t.chunk == 0 and t.tensor == "kv" for _, t in s.sends))
    assert send_at == wait_at + 1


def _two_node_plan(method: str):
    """(plan, pattern): a causal sliding window at 512 tokens on 2x2, planned by the ILP planner ("ultraattn") or a
    baseline's builder: relays across the node link, and partials."""
    from ultraattn.planner.api import plan
    from ultraattn.planner.tiling import PlannerOptions

    s = 512
    pat = pattern_from_mask_mod(generate_sliding_window(160, causal=True), s, block_size=32)
    shape = AttnShape(seq_len=s, num_heads=4, head_dim=16, num_kv_heads=2, dtype="fp32")
    mesh = Mesh(nodes=2, devices=2)
    if method == "ultraattn":
        return plan(pat, shape, mesh, options=PlannerOptions(ilp_time_limit=1.0, heuristic_seconds=0.05,
                                                               time_budget=3.0, schedule_ilp=False)).plan, pat
    return baseline_plan(method, pat, shape, mesh), pat


@pytest.mark.parametrize("async_kernels", [0.0, 1.0])
@pytest.mark.parametrize("method", ["ultraattn", "ring", "usp"])
def test_executed_replay_runs_each_ranks_program(method, async_kernels):
    """``evaluate(executed=True)`` replays the executor's own programs: launches in program order, each after every
    wait before it; a partial after its row's launches; and the programs post every message of the plan exactly
    once, on both ends. A send leaves after the launches and waits before it in its rank's program where the host
    runs the kernels (``async_kernels=0``, CPU ranks); on a GPU's communication stream a post that only relays
    leaves after the waits before it alone, and on the ring some relay does leave before its rank's earlier
    launches end (``runtime/streams.py``)."""
    import dataclasses

    from ultraattn.planner.api import evaluate
    from ultraattn.planner.cost import DEFAULT_COST
    from ultraattn.planner.program import Launch, Post, Wait, rank_program, relays

    # slow kernels, so that a relayed unit lands while its rank still runs an earlier launch
    cost = dataclasses.replace(DEFAULT_COST, async_kernels=async_kernels, fwd_tflops=0.5, bwd_tflops=0.5)
    tp, pat = _two_node_plan(method)
    early_relays = 0
    for phase in ("fwd", "bwd"):
        ev = evaluate(tp, pat, cost=cost, backward=True, executed=True)
        sched = ev.fwd if phase == "fwd" else ev.bwd
        sched.check()
        first = sched.graph.kernels
        msg_task = {idx: first + n for n, idx in enumerate(i for i, t in enumerate(tp.transfers) if t.phase == phase)}
        sent, got = [], []
        for r in range(tp.world):
            done = 0.0          # when the rank's host is past its last launch and waits
            waited = 0.0        # when the messages the rank waited for so far have landed
            last_launch = -1.0
            posted = {}
            for n, step in enumerate(rank_program(tp, r, phase, tp.order.get(phase) or
                                                  _plain_order(tp, pat, phase, cost))):
                if isinstance(step, Post):
                    posted[n] = step.recvs
                    relay_only = async_kernels and all(relays(tp, t) for _idx, t in step.sends)
                    for idx, _t in step.sends:
                        assert sched.start[msg_task[idx]] >= (waited if relay_only else done) - 1e-12
                        early_relays += bool(relay_only and sched.start[msg_task[idx]] < done - 1e-12)
                    sent += [idx for idx, _ in step.sends]
                    got += [idx for idx, _ in step.recvs]
                elif isinstance(step, Wait):
                    ends = [sched.end[msg_task[idx]] for idx, _ in posted[step.post]]
                    done = max([done, *ends])
                    waited = max([waited, *ends])
                else:
                    assert isinstance(step, Launch)
                    for k in step.kernels:
                        assert sched.start[k] >= max(done, last_launch) - 1e-12
                        last_launch = sched.start[k]
                        done = sched.end[k]
        assert sorted(sent) == sorted(got) == sorted(msg_task)
        for n, t in enumerate(tp.transfers_for(phase)):
            if t.tensor in ("o", "dq"):
                row_launches = [k for k, kern in enumerate(tp.kernels)
                                if kern.rank == t.src and any(c[0] == t.chunk for c in kern.cells)]
                assert all(sched.start[first + n] >= sched.end[k] - 1e-12 for k in row_launches)
    if method == "ring":
        assert (early_relays > 0) == bool(async_kernels)


@pytest.mark.parametrize("method", ["ultraattn", "ring", "usp"])
def test_a_relay_never_shares_a_post_with_what_launches_make(method):
    """A post whose sends only relay waits for no launch on a GPU (``runtime/streams.py``), so the program posts
    relays apart from sends of units or partials its rank makes or holds: grouped, the relay would leave after the
    launches before the post (on 128K 8x8 USP plans a K/V unit bound for the next node waited for a 0.2 ms launch
    that way). Every message is still posted once, in the same order per pair of ranks."""
    from ultraattn.planner.cost import DEFAULT_COST
    from ultraattn.planner.program import Post, rank_program, relays

    tp, pat = _two_node_plan(method)
    relay_posts = 0
    for phase in ("fwd", "bwd"):
        order = tp.order.get(phase) or _plain_order(tp, pat, phase, DEFAULT_COST)
        local = {idx: n for n, idx in enumerate(i for i, t in enumerate(tp.transfers) if t.phase == phase)}
        keys = order.leaves or order.transfers
        for r in range(tp.world):
            sends = []
            for step in rank_program(tp, r, phase, order):
                if isinstance(step, Post) and step.sends:
                    kinds = {relays(tp, t) for _idx, t in step.sends}
                    assert len(kinds) == 1, (method, phase, r, step.sends)
                    relay_posts += kinds == {True}
                    sends += [idx for idx, _t in step.sends]
            # the sends in the run order's order (grouping changes, order does not)
            assert sends == sorted(sends, key=lambda i: (order.transfers[local[i]], keys[local[i]], local[i]))
    assert relay_posts > 0 or method == "ultraattn", method


def _plain_order(tp, pat, phase, cost):
    from ultraattn.planner.api import evaluate
    from ultraattn.planner.program import run_order

    ev = evaluate(tp, pat, cost=cost, backward=True)
    return run_order(ev.fwd if phase == "fwd" else ev.bwd)


def test_program_rejects_an_order_that_sends_a_partial_before_its_launches():
    """A run order that does not fit its plan (a partial's key before its row's launch) fails when the program is
    built, naming the transfer, instead of sending an unfinished partial."""
    import dataclasses

    from ultraattn.planner.plan import RunOrder
    from ultraattn.planner.program import unit_order

    pat = pattern_from_mask_mod(generate_sliding_window(256, causal=False), 256, block_size=32)
    plan = baseline_plan("usp", pat, _shape(), Mesh(nodes=1, devices=2))
    good = unit_order(plan, "fwd")
    msgs = plan.transfers_for("fwd")
    n = next(n for n, t in enumerate(msgs) if t.tensor in ("o", "out"))
    bad = RunOrder(kernels=tuple(k + 100.0 for k in good.kernels), transfers=good.transfers)
    with pytest.raises(PlanExecutionError, match=f"leaves rank {msgs[n].src} before its launches there"):
        build_program(dataclasses.replace(plan, order={"fwd": bad}), msgs[n].src)


def test_program_rejects_a_plan_that_sends_data_its_source_lacks():
    assign = torch.full((1, 2, 2), -1, dtype=torch.int32)
    assign[0, 0, 0] = 0
    assign[0, 1, 1] = 1
    bad = TilePlan(method="bad", mesh=Mesh(nodes=1, devices=2), shape=_shape(), chunk_size=128, num_chunks=2,
                   owner=(0, 1), num_head_groups=1, assign_GPP=assign,
                   kernels=(Kernel(rank=0, head_group=0, cells=((0, 0),)),
                            Kernel(rank=1, head_group=0, cells=((1, 1),))),
                   transfers=(Transfer(tensor="kv", chunk=0, head_group=0, src=1, dst=0, nbytes=1, phase="fwd"),))
    with pytest.raises(PlanExecutionError, match="leaves rank 1, which never holds that unit"):
        build_program(bad, 0)


def test_plan_attention_argument_errors():
    with pytest.raises(ValueError, match="`seqlen` must be a positive int"):
        ultraattn.plan_attention("causal", seqlen=0, num_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="`method` must be one of"):
        ultraattn.plan_attention("causal", seqlen=64, num_heads=2, head_dim=16, method="magic")
    with pytest.raises(ValueError, match="`dtype` must be one of"):
        ultraattn.plan_attention("causal", seqlen=64, num_heads=2, head_dim=16, dtype=torch.int32)
    with pytest.raises(ValueError, match="'causal' or 'full'"):
        ultraattn.plan_attention("diagonal", seqlen=64, num_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="num_kv_heads must divide"):
        ultraattn.plan_attention("causal", seqlen=64, num_heads=4, num_kv_heads=3, head_dim=16)
    pat = pattern_from_mask_mod(generate_sliding_window(20), 64, block_size=16)
    with pytest.raises(ValueError, match="PARTIAL blocks but no `mask_mod`"):
        ultraattn.plan_attention(pat, seqlen=64, num_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="lengths \\(64, 64\\) but seqlen=32"):
        ultraattn.plan_attention(pat, seqlen=32, num_heads=2, head_dim=16)
    with pytest.raises(TypeError, match="ultraattn: `score_mod` must be a FlexAttention score_mod .* got 3.0"):
        ultraattn.plan_attention("causal", seqlen=64, num_heads=2, head_dim=16, score_mod=3.0)


def test_world_size_without_process_group_is_an_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=4 but torch.distributed is not initialised"):
        ultraattn.plan_attention("causal", seqlen=64, num_heads=2, head_dim=16)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RuntimeError, match="`mesh`/`group` given but torch.distributed is not initialised"):
        ultraattn.plan_attention("causal", seqlen=64, num_heads=2, head_dim=16, group=object())


def test_dispatch_undispatch_roundtrip_and_errors():
    plan = ultraattn.plan_attention("causal", seqlen=100, num_heads=2, head_dim=8, dtype=torch.float32,
                                    block_size=16)
    x = torch.randn(1, 2, 100, 8)
    loc = ultraattn.dispatch(x, plan)
    assert loc.shape[2] == plan.local_len >= 100
    assert torch.equal(ultraattn.undispatch(loc, plan), x)
    with pytest.raises(ValueError, match="has 99 tokens on seq_dim=2 but the plan is for seqlen=100"):
        ultraattn.dispatch(x[:, :, :99], plan)
    with pytest.raises(ValueError, match="seq_dim`=5 is out of range"):
        ultraattn.dispatch(x, plan, seq_dim=5)
    with pytest.raises(ValueError, match="did you pass a global tensor"):
        ultraattn.undispatch(x, plan)
    with pytest.raises(TypeError, match="`plan` must be an AttentionPlan"):
        ultraattn.dispatch(x, "causal")
    q = torch.randn(1, 2, plan.local_len, 8)
    with pytest.raises(ValueError, match="dtype torch.float16 but the plan was made for torch.float32"):
        ultraattn.dist_attention(q.half(), q, q, plan)
    with pytest.raises(ValueError, match="`k_local` has shape"):
        ultraattn.dist_attention(q, q[:, :1, :5], q, plan)


class _RecordingStreams:
    """The stream operations of ``runtime.streams.CudaStreams``, recorded instead of run (no GPU here)."""

    def __init__(self):
        self.log: list = []
        self.where = "compute"

    @contextlib.contextmanager
    def on_comm(self):
        self.where = "comm"
        try:
            yield
        finally:
            self.where = "compute"

    def comm_waits_compute(self):   # (CudaStreams reads the compute stream as the current one: off on_comm)
        self.log.append("comm waits compute" if self.where == "compute" else "comm waits itself")

    def compute_waits_comm(self):
        self.log.append("compute waits comm" if self.where == "compute" else "comm waits itself")

    def read_by_comm(self, t):
        self.log.append(("read by comm", id(t)))

    def read_by_compute(self, t):
        self.log.append(("read by compute", id(t)))


def test_comm_stream_relays_received_bytes_without_waiting_for_compute():
    """On a GPU (``runtime/streams.py``, recorded here): receives are taken on the communication stream and the
    compute stream waits for them; a post whose pieces were all taken there (a relay) waits for nothing on the
    compute stream; a post with a piece a kernel made (or a copy of a received piece) waits for the compute stream
    first, and every such piece is kept alive for the communication stream; the work itself runs on that stream."""
    from ultraattn.runtime.streams import CommStreams

    api = _RecordingStreams()
    cs = CommStreams(torch.device("cpu"), api=api)
    assert cs.active and CommStreams(torch.device("cpu")).active is False   # on CPU by default: the host order
    ran = []
    got = cs.take(lambda: ran.append(api.where) or [("kv", [torch.ones(2), torch.zeros(2)])])
    assert ran == ["comm"] and api.where == "compute"
    pieces = got[0][1]
    assert api.log == ["compute waits comm", ("read by compute", id(pieces[0])), ("read by compute", id(pieces[1]))]
    assert all(cs.made_here(p) for p in pieces)
    api.log.clear()
    assert cs.post(pieces, lambda: api.where) == "comm"
    assert api.log == []                                   # a relay: nothing to wait for
    partial = torch.full((2,), 3.0)
    copy = pieces[0] * 1                                   # a kernel's copy of a received piece is the kernel's
    assert not cs.made_here(copy)
    assert cs.post([pieces[0], partial, copy], lambda: api.where) == "comm"
    assert api.log == ["comm waits compute", ("read by comm", id(partial)), ("read by comm", id(copy))]


def test_comm_stream_switch_names_its_values(monkeypatch):
    from ultraattn.runtime.streams import comm_stream_enabled

    monkeypatch.setenv("ULTRAATTN_COMM_STREAM", "0")
    assert comm_stream_enabled() is False
    monkeypatch.setenv("ULTRAATTN_COMM_STREAM", "yes")
    with pytest.raises(ValueError, match="ultraattn: ULTRAATTN_COMM_STREAM='yes' must be '0'"):
        comm_stream_enabled()

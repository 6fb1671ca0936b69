"""Where PuLP is missing (the GPU machine has none), the package, the kernels, the fast planner, the
runtime and the CLI still work; only the ILP planner, asked for by name, fails, and its error says
how to get PuLP or which planner to use instead.

One subprocess with ``pulp`` made unimportable (``sys.modules["pulp"] = None``: imports fail and
``importlib.util.find_spec`` answers None, as when it is not installed) runs every check and
reports; the assertions are here."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_CHECKS = textwrap.dedent("""
    import io, json, sys
    from contextlib import redirect_stdout, redirect_stderr

    sys.modules["pulp"] = None  # import pulp raises ModuleNotFoundError, find_spec says None: not installed
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    import ultraattn
    from ultraattn import cli
    from ultraattn.planner.ilp import have_pulp

    out = {"have_pulp": have_pulp(), "pulp_loaded": sys.modules["pulp"] is not None}
    torch.manual_seed(0)
    S, H, D = 128, 2, 16
    q, k, v = (torch.randn(1, H, S, D) for _ in range(3))
    doc = torch.tensor([0] * 48 + [1] * 80)
    bm = create_block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i), None, None, S, S, device="cpu",
                           BLOCK_SIZE=32)
    dense = (doc[:, None] == doc[None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=dense)
    for mask in ("causal", bm):
        plan = ultraattn.plan_attention(mask, seqlen=S, num_heads=H, head_dim=D, dtype=torch.float32,
                                        block_size=32)
        name = "causal" if mask == "causal" else "blockmask"
        out[f"planner_{name}"] = plan.planner
        if name == "blockmask":
            o = ultraattn.dist_attention(*(ultraattn.dispatch(t, plan) for t in (q, k, v)), plan,
                                         return_lse=False)
            out["max_err"] = (ultraattn.undispatch(o, plan).double() - ref).abs().max().item()
    try:
        ultraattn.plan_attention("causal", seqlen=S, num_heads=H, head_dim=D, planner="ilp")
        out["ilp_error"] = None
    except ModuleNotFoundError as exc:
        out["ilp_error"] = str(exc)
    for argv in (["plan", "--mask", "causal", "--seqlen", "4k", "--heads", "4", "--head-dim", "64", "--cp", "4",
                  "--quiet"],
                 ["plan", "--mask", "causal", "--seqlen", "4k", "--heads", "4", "--head-dim", "64", "--cp", "4",
                  "--quiet", "--planner", "ilp"]):
        buf, err = io.StringIO(), io.StringIO()
        with redirect_stdout(buf), redirect_stderr(err):
            try:
                rc = cli.main(argv)
            except SystemExit as e:
                rc = e.code
        out["cli_" + argv[-1]] = {"rc": rc, "out": buf.getvalue(), "err": err.getvalue()}
    out["pulp_loaded_at_end"] = sys.modules["pulp"] is not None
    print("RESULT" + json.dumps(out))
""")


def test_everything_but_the_ilp_planner_works_without_pulp():
    r = subprocess.run([sys.executable, "-c", _CHECKS], capture_output=True, text=True, timeout=300)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line, f"checks failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    out = json.loads(line[len("RESULT"):])
    assert out["have_pulp"] is False and out["pulp_loaded"] is False
    # auto picks the fast planner for every mask, the compile-time "causal" included, and it is exact
    assert out["planner_causal"] == "fast" and out["planner_blockmask"] == "fast"
    assert out["max_err"] < 1e-5  # fp32 against an fp64 reference
    # planner="ilp" by name: an error naming the fix, raised before any planning
    assert out["ilp_error"] and "pip install pulp" in out["ilp_error"] and "planner='fast'" in out["ilp_error"]
    # the CLI: auto plans (fast), --planner ilp exits 2 with the same advice
    assert out["cli_--quiet"]["rc"] in (0, None), out["cli_--quiet"]
    assert "fast" in out["cli_--quiet"]["out"]
    assert out["cli_ilp"]["rc"] == 2 and "pip install pulp" in out["cli_ilp"]["err"], out["cli_ilp"]
    assert out["pulp_loaded_at_end"] is False

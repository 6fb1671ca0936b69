"""Context-parallel block-sparse attention with ultraattn's runtime, checked against one device.

    torchrun --nproc-per-node 4 examples/dist_attention.py      # 4 gloo ranks on CPU
    python examples/dist_attention.py                          # one process works too

Every rank holds the same global q, k, v (the "global view"); each computes only its
planned share and the result is gathered back and compared with plain attention.
"""

import os

import torch
import torch.distributed as dist

import ultraattn
from ultraattn.masks import generate_global_local, generate_sliding_window, or_masks


def main() -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    seqlen, heads, kv_heads, dim = 2000, 8, 2, 64   # GQA 4:1; 2000 is not a multiple of the block
    mask = or_masks(generate_sliding_window(256), generate_global_local(64, 64))
    plan = ultraattn.plan_attention(mask, seqlen=seqlen, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                                    dtype=torch.float32)
    torch.manual_seed(0)  # same global inputs on every rank
    q = torch.randn(1, heads, seqlen, dim, requires_grad=True)
    k = torch.randn(1, kv_heads, seqlen, dim, requires_grad=True)
    v = torch.randn(1, kv_heads, seqlen, dim, requires_grad=True)

    out_local, lse_local = ultraattn.dist_attention(*(ultraattn.dispatch(x, plan) for x in (q, k, v)), plan)
    out = ultraattn.undispatch(out_local, plan)
    out.sum().backward()

    # single-device reference
    from ultraattn.masks.convert import eval_mask
    idx = torch.arange(seqlen)
    dense = eval_mask(mask, torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.zeros(1, 1, 1, 1, dtype=torch.long),
                       idx.view(1, 1, -1, 1), idx.view(1, 1, 1, -1))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                                           attn_mask=dense)
    err = (out - ref).abs().max().item()
    log = plan.comm_log["fwd"].totals().get("fwd", {"sent": 0})
    print(f"rank {rank}/{plan.world}: {plan}; max |out - reference| = {err:.2e}; forward sent {log['sent']} B "
          f"(plan: {plan.predicted_bytes('fwd')['sent']} B)")
    assert err < 1e-4
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

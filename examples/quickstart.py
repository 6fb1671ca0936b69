"""Quickstart: a single-device training script made context parallel by one line, torch.compile(backend="ultraattn").

    python examples/quickstart.py                              # one process (world size 1)
    torchrun --nproc-per-node 2 examples/quickstart.py         # 2 ranks: gloo on CPU, NCCL with a GPU per rank

Every rank runs this same script on the same full-sequence batch: the backend splits the sequence across the ranks
itself (no DistributedSampler over the context-parallel ranks). The losses printed are those of one process.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, SEQLEN = 256, 64, 4, 1024


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # the call ultraattn makes context parallel
        x = x + self.out(y.transpose(1, 2).reshape(b, s, DIM))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB, bias=False)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def batch(step: int, device) -> torch.Tensor:
    """The step's batch: the same full sequence on every rank (seeded by the step)."""
    return torch.randint(0, VOCAB, (1, SEQLEN), generator=torch.Generator().manual_seed(step)).to(device)


def main(steps: int = 3) -> None:
    device = torch.device("cpu")
    if "RANK" in os.environ:  # launched by torchrun
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(0)  # the same weights on every rank
    model = Model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="ultraattn")  # the only change to a single-device script
    for step in range(steps):
        loss = compiled(batch(step, device))
        loss.backward()  # every rank ends with the full gradients, as one process would
        optimizer.step()
        optimizer.zero_grad()
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.6f}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

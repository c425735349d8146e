"""Single-GPU workloads for the diagnosis check on a GPU host (bench/diagnosis_gpu.py), each the way it is usually
written:
- `copy-out-pageable`: results copied to the host each step with `.cpu()` into pageable memory (a blocking copy
  through a staging buffer: the GPU waits on PCIe tx);
- `copy-out-pinned`: the same into a pinned buffer with `non_blocking=True`, synchronised each step;
- `matmul`: a bf16 8192x8192 matmul loop (a second tenant beside a job: a notebook, a benchmark);
- `decode-tiny`: token-by-token greedy decoding at batch 1 of a small transformer (12 layers, d=768, random weights,
  no download) from a Python loop, a KV cache kept by hand: many tiny kernels, the GPU mostly between them.
Run for `--seconds`, then exit 0.
  python3 bench/workloads/single_gpu.py --job copy-out-pageable --seconds 90
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

MIB = 1 << 20


def copy_out(args: argparse.Namespace, pinned: bool) -> None:
    device = torch.device("cuda", args.gpu)
    results = torch.randn(args.copy_mib * MIB // 4, device=device)
    host = torch.empty(results.shape, dtype=results.dtype, pin_memory=True) if pinned else None
    started = time.monotonic()
    while time.monotonic() - started < args.seconds:
        results.mul_(1.0001)  # a step's (tiny) work on the device
        if host is None:
            results.cpu()  # pageable: staged and blocking
        else:
            host.copy_(results, non_blocking=True)
            torch.cuda.synchronize(device)


def matmul(args: argparse.Namespace) -> None:
    device = torch.device("cuda", args.gpu)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    started = time.monotonic()
    while time.monotonic() - started < args.seconds:
        for _ in range(20):
            a = (a @ b).clamp_(-1, 1)
        torch.cuda.synchronize(device)


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        if cache:
            k, v = torch.cat([cache[0], k], dim=1), torch.cat([cache[1], v], dim=1)
        cache[:] = [k, v]
        b, t, w = q.shape
        split = lambda z: z.view(b, -1, self.heads, w // self.heads).transpose(1, 2)  # noqa: E731
        attended = nn.functional.scaled_dot_product_attention(split(q), split(k), split(v))
        x = x + self.out(attended.transpose(1, 2).reshape(b, t, w))
        return x + self.mlp(self.norm2(x))


def decode_tiny(args: argparse.Namespace) -> None:
    device = torch.device("cuda", args.gpu)
    width, vocab = 768, 32000
    embed, head = nn.Embedding(vocab, width).to(device), nn.Linear(width, vocab).to(device)
    blocks = nn.ModuleList(Block(width, 12) for _ in range(12)).to(device).eval()
    started = time.monotonic()
    with torch.inference_mode():
        while time.monotonic() - started < args.seconds:
            token, caches = torch.randint(0, vocab, (1, 1), device=device), [[] for _ in blocks]
            for _ in range(128):
                x = embed(token)
                for block, cache in zip(blocks, caches, strict=True):
                    x = block(x, cache)
                token = head(x[:, -1:]).argmax(-1)
                token.item()  # the next step needs the token on the host (stopping criteria, streaming)


JOBS = {
    "copy-out-pageable": lambda a: copy_out(a, pinned=False),
    "copy-out-pinned": lambda a: copy_out(a, pinned=True),
    "matmul": matmul,
    "decode-tiny": decode_tiny,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", choices=sorted(JOBS), required=True)
    parser.add_argument("--seconds", type=float, default=90)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--copy-mib", type=int, default=256, help="MiB copied out each step")
    args = parser.parse_args()
    JOBS[args.job](args)


if __name__ == "__main__":
    main()

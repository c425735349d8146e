"""Real training jobs for GPU-host soaks and the diagnosis suite, written the way ML engineers write them.

One script, several jobs (`--job`):
- `transformer`: a transformer encoder language-model step loop (AdamW, grad clipping, a DataLoader with worker
  processes and pinned memory, a checkpoint every `--checkpoint-every` steps), bf16 autocast or FP32; under
  `torch.distributed.run` it is DistributedDataParallel over NCCL, one rank per GPU;
  `--slow-rank R --slow-kind cpu|sleep|input|hang --slow-after S` makes rank R a straggler from S s on: Python CPU
  work each step, a sleep, a starved DataLoader (two workers, `--slow-seconds` of CPU per sample), or a hang;
- `fill`: takes `--fill-share` of the GPU's free memory through PyTorch's allocator, touches it, and holds it.

Run for `--seconds`, then exit 0. Examples (2 GPUs):
  python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/workloads/train.py --seconds 120
  python3 bench/workloads/train.py --job transformer --precision fp32 --seconds 60
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class TokenStream(Dataset):
    """Random token sequences made on the CPU in the loader's workers, as a tokenised corpus would be read."""

    def __init__(self, length: int, seq: int, vocab: int, onset: Onset | None = None, cost: float = 0.0) -> None:
        self.length, self.seq, self.vocab = length, seq, vocab
        self.onset, self.cost = onset, cost  # a starved loader: from the onset on, `cost` s of CPU per sample

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.onset is not None and self.onset.passed():  # decoding grew expensive (larger images, a tokenizer)
            _spin(self.cost)
        generator = torch.Generator().manual_seed(index)
        return torch.randint(0, self.vocab, (self.seq + 1,), generator=generator)


class Onset:
    """When the straggler starts: `after` seconds from the job's start, or the wall-clock instant a driver writes
    into `path` once the job runs (bench/straggler_suite.py), whichever is given."""

    def __init__(self, after: float, path: str | None) -> None:
        self.at = None if path else time.time() + after
        self.path = path

    def passed(self) -> bool:
        if self.at is None and self.path and os.path.exists(self.path):
            with open(self.path) as handle:
                self.at = float(handle.read() or "inf")
        return self.at is not None and time.time() >= self.at


def _spin(seconds: float) -> None:
    """CPU work in Python for `seconds` (a preprocessing step, not a sleep: the thread runs)."""
    end = time.perf_counter() + seconds
    total = 0
    while time.perf_counter() < end:
        total += sum(range(200))


class LanguageModel(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens), is_causal=False))


def transformer(args: argparse.Namespace) -> None:
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("nccl")
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
    else:
        rank, world, local = 0, 1, args.gpu
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    model = LanguageModel(args.vocab, args.width, args.layers, args.heads).to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[local])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    onset = Onset(args.slow_after, args.onset_file)
    straggling = args.slow_rank is not None and rank == args.slow_rank
    slow_input = straggling and args.slow_kind == "input"
    data = TokenStream(10_000_000, args.seq, args.vocab, onset if slow_input else None, args.slow_seconds)
    sampler = DistributedSampler(data, world, rank, shuffle=True) if distributed else None
    loader = DataLoader(
        data,
        batch_size=args.batch,
        sampler=sampler,
        shuffle=sampler is None,
        num_workers=2 if slow_input else args.workers,
        pin_memory=True,
        drop_last=True,
        persistent_workers=args.workers > 0,
    )
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.precision == "bf16")
    loss_fn = nn.CrossEntropyLoss()
    started = time.monotonic()
    for step, tokens in enumerate(loader, start=1):
        tokens = tokens.to(device, non_blocking=True)
        if straggling and onset.passed():
            if args.slow_kind == "sleep":
                time.sleep(args.slow_seconds)  # a straggler: this rank's host side is late every step
            elif args.slow_kind == "cpu":
                _spin(args.slow_seconds)  # Python work only this rank does (metrics, logging, evaluation)
            elif args.slow_kind == "hang":
                print(f"rank {rank} hangs", flush=True)
                time.sleep(86400)  # a deadlock in this rank's host code: the others wait in the next all-reduce
        with autocast:
            logits = model(tokens[:, :-1])
            loss = loss_fn(logits.reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if args.checkpoint_every and step % args.checkpoint_every == 0 and rank == 0:
            state = (model.module if distributed else model).state_dict()
            torch.save({"model": state, "optimizer": optimizer.state_dict(), "step": step}, args.checkpoint_path)
        if step % 20 == 0 and rank == 0:
            print(f"step {step} loss {loss.item():.3f} {time.monotonic() - started:.0f}s", flush=True)
        if _time_is_up(time.monotonic() - started > args.seconds, device, distributed):
            break
    torch.cuda.synchronize()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def _time_is_up(mine: bool, device: torch.device, distributed: bool) -> bool:
    """Every rank stops at the same step: one rank leaving on its own clock leaves the others in an all-reduce
    that never completes (the hang the first soak hit at teardown)."""
    if not distributed:
        return mine
    flag = torch.tensor([1.0 if mine else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def fill(args: argparse.Namespace) -> None:
    torch.cuda.set_device(args.gpu)
    free, _ = torch.cuda.mem_get_info()
    chunk = 1 << 30
    held = []
    while sum(t.numel() for t in held) + chunk < free * args.fill_share:
        held.append(torch.ones(chunk, dtype=torch.uint8, device="cuda"))
    print(f"holding {sum(t.numel() for t in held) / 2**30:.1f} GiB of {free / 2**30:.1f} GiB free", flush=True)
    time.sleep(args.seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", choices=["transformer", "fill"], default="transformer")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--checkpoint-every", type=int, default=200)
    parser.add_argument("--checkpoint-path", default="/tmp/gpuwarden-train-ckpt.pt")
    parser.add_argument("--slow-rank", type=int)
    parser.add_argument("--slow-seconds", type=float, default=0.2)
    parser.add_argument("--slow-after", type=float, default=0.0, help="seconds before the straggler starts")
    parser.add_argument("--onset-file", help="the straggler starts at the wall time written here (by a driver)")
    parser.add_argument("--slow-kind", choices=["sleep", "cpu", "input", "hang"], default="sleep")
    parser.add_argument("--fill-share", type=float, default=0.95)
    args = parser.parse_args()
    (fill if args.job == "fill" else transformer)(args)


if __name__ == "__main__":
    main()

"""Real training jobs for GPU-host soaks and the diagnosis suite, written the way ML engineers write them.

One script, several jobs (`--job`), each the way such a job is usually written:
- `transformer`: a transformer encoder language-model step loop (AdamW, grad clipping, a DataLoader with worker
  processes and pinned memory, a checkpoint every `--checkpoint-every` steps), bf16 autocast or FP32; under
  `torch.distributed.run` it is DistributedDataParallel over NCCL, one rank per GPU; `--schedule FILE` makes ranks
  stragglers for a while, as a driver appends injections (class Schedule: CPU work, a sleep, a starved loader, a hang);
- `fsdp`: the same model sharded with FSDP2's fully_shard (bf16 parameters, FP32 reduction, one unit per layer);
- `comm-heavy`: DDP of a wide MLP at a batch of 8 rows (2.1 GB of gradients a step);
- `allreduce`: all-reduce of a 1 GiB buffer in a loop;
- `pipeline`: two pipeline stages exchanging activations and gradients with send/recv (GPipe, 4 micro-batches);
- `decode`: Hugging Face generate() of a GPT-2-medium-sized model, bf16, batch 8;
- `elementwise`: LayerNorm + softmax + GELU over bf16 tensors, forward and backward (no matmul);
- `fill`: takes `--fill-share` of the GPU's free memory through PyTorch's allocator, touches it, and holds it.

Run for `--seconds`, then exit 0. Examples (2 GPUs):
  python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/workloads/train.py --seconds 120
  python3 bench/workloads/train.py --job transformer --precision fp32 --seconds 60
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Schedule:
    """Straggler injections that a driver (bench/straggler_suite.py) appends to a JSON-lines file while the job
    runs: {"start": wall time, "end": wall time, "rank": R, "kind": "cpu"|"sleep"|"input"|"hang", "seconds": S}.
    Every rank (and every loader worker) re-reads the file when it changes, so one job can straggle at several ranks
    and causes in turn, and recover between them, as a real job's straggler comes and goes."""

    def __init__(self, path: str | None) -> None:
        self.path, self.stamp, self.entries = path, None, []

    def active(self, rank: int, now: float | None = None) -> dict | None:
        if not self.path:
            return None
        try:
            stamp = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return None
        if stamp != self.stamp:
            with open(self.path) as handle:
                self.entries = [json.loads(line) for line in handle if line.strip()]
            self.stamp = stamp
        now = time.time() if now is None else now
        for entry in self.entries:
            if entry["rank"] == rank and entry["start"] <= now < entry["end"]:
                return entry
        return None


class TokenStream(Dataset):
    """Random token sequences made on the CPU in the loader's workers, as a tokenised corpus would be read; while
    the schedule starves this rank's input, each sample costs `seconds` of CPU (a slow decoder or tokenizer)."""

    def __init__(self, length: int, seq: int, vocab: int, schedule: Schedule, rank: int, cost: float = 0.0) -> None:
        self.length, self.seq, self.vocab = length, seq, vocab
        self.schedule, self.rank, self.cost = schedule, rank, cost

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        injection = self.schedule.active(self.rank)
        if injection and injection["kind"] == "input":
            _spin(injection["seconds"])
        elif self.cost:
            _spin(self.cost)  # every sample costs this much CPU to decode (an input-bound job from the start)
        generator = torch.Generator().manual_seed(index)
        return torch.randint(0, self.vocab, (self.seq + 1,), generator=generator)


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


def _setup(args: argparse.Namespace) -> tuple[int, int, torch.device, bool]:
    """(rank, world, device, distributed): NCCL on GPUs, gloo with `--device cpu` (to try a job without a GPU)."""
    distributed = "RANK" in os.environ
    cuda = args.device == "cuda"
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
    else:
        rank, world, local = 0, 1, args.gpu
    if not cuda:
        return rank, world, torch.device("cpu"), distributed
    torch.cuda.set_device(local)
    return rank, world, torch.device("cuda", local), distributed


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _token_loader(args: argparse.Namespace, rank: int, world: int, distributed: bool, schedule: Schedule) -> DataLoader:
    data = TokenStream(10_000_000, args.seq, args.vocab, schedule, rank, args.sample_cost)
    sampler = DistributedSampler(data, world, rank, shuffle=True) if distributed else None
    return DataLoader(
        data,
        batch_size=args.batch,
        sampler=sampler,
        shuffle=sampler is None,
        num_workers=args.workers,
        pin_memory=args.device == "cuda",
        drop_last=True,
        persistent_workers=args.workers > 0,
    )


def _straggle(schedule: Schedule, rank: int) -> None:
    """This rank's host-side delay for this step, if the schedule says it straggles now."""
    injection = schedule.active(rank)
    if not injection:
        return
    if injection["kind"] == "sleep":
        time.sleep(injection["seconds"])  # this rank's host side is late every step (a lock, a blocking call)
    elif injection["kind"] == "cpu":
        _spin(injection["seconds"])  # Python work only this rank does (metrics, logging, evaluation)
    elif injection["kind"] == "hang":
        print(f"rank {rank} hangs", flush=True)
        time.sleep(86400)  # a deadlock in this rank's host code: the others wait in the next all-reduce


def transformer(args: argparse.Namespace) -> None:
    """The language-model step loop: DDP (default), FSDP (`--job fsdp`), or one GPU."""
    rank, world, device, distributed = _setup(args)
    model = LanguageModel(args.vocab, args.width, args.layers, args.heads).to(device)
    if distributed and args.job == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        half = torch.bfloat16 if args.precision == "bf16" else torch.float32
        policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
        for block in model.encoder.layers:  # one unit per layer: its all-gather overlaps the previous layer's compute
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    elif distributed:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.index is not None else None
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    schedule = Schedule(args.schedule)
    loader = _token_loader(args, rank, world, distributed, schedule)
    autocast = torch.autocast(
        device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16" and args.job != "fsdp"
    )
    loss_fn = nn.CrossEntropyLoss()
    started = time.monotonic()
    for step, tokens in enumerate(loader, start=1):
        tokens = tokens.to(device, non_blocking=True)
        _straggle(schedule, rank)
        with autocast:
            logits = model(tokens[:, :-1])
            loss = loss_fn(logits.reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            _checkpoint(args, model, optimizer, step, rank, distributed)
        if step % 20 == 0 and rank == 0:
            print(f"step {step} loss {loss.item():.3f} {time.monotonic() - started:.0f}s", flush=True)
        if _time_is_up(time.monotonic() - started > args.seconds, device, distributed):
            break
    _finish(device, distributed)


def _checkpoint(args: argparse.Namespace, model: nn.Module, optimizer, step: int, rank: int, distributed: bool) -> None:
    """Rank 0 writes model and optimizer state (DDP's usual torch.save); under FSDP every rank gathers the full
    model state first (a full state dict costs every rank the all-gather)."""
    if args.job == "fsdp" and distributed:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = (model.module if distributed else model).state_dict()
    if rank == 0:
        torch.save({"model": state, "optimizer": optimizer.state_dict(), "step": step}, args.checkpoint_path)


def _finish(device: torch.device, distributed: bool) -> None:
    _synchronize(device)
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


def comm_heavy(args: argparse.Namespace) -> None:
    """DDP of a wide MLP (~537 M FP32 parameters: 2.1 GB of gradients a step) on a batch of 8 rows: the step is the
    all-reduce, as in a large model fine-tuned at a tiny per-GPU batch."""
    rank, world, device, distributed = _setup(args)
    width = args.width * 4
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(args.layers * 4)])
    model = model.to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.index is not None else None
        )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    started = time.monotonic()
    while True:
        batch = torch.randn(8, width, device=device)
        loss = model(batch).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if _time_is_up(time.monotonic() - started > args.seconds, device, distributed):
            break
    _finish(device, distributed)


def allreduce(args: argparse.Namespace) -> None:
    """All-reduce of a 1 GiB bf16 buffer in a loop (nccl-tests' all_reduce_perf, as a bandwidth check runs it)."""
    rank, world, device, distributed = _setup(args)
    buffer = torch.ones(512 * 2**20, dtype=torch.bfloat16, device=device)
    started = time.monotonic()
    while True:
        for _ in range(10):
            dist.all_reduce(buffer)
        if _time_is_up(time.monotonic() - started > args.seconds, device, distributed):
            break
    _finish(device, distributed)


def pipeline(args: argparse.Namespace) -> None:
    """Two-stage pipeline parallelism, GPipe schedule with send/recv: rank 0 holds the embedding and the first half
    of the layers, rank 1 the rest and the head; each step runs 4 micro-batches forward, then backward, so each
    stage idles while the other works (the bubble)."""
    rank, world, device, distributed = _setup(args)
    if world != 2:
        raise SystemExit("--job pipeline runs on exactly 2 ranks")

    def layer() -> nn.Module:
        return nn.TransformerEncoderLayer(
            args.width, args.heads, 4 * args.width, 0.1, batch_first=True, norm_first=True
        )

    half = args.layers // 2
    if rank == 0:
        stage = nn.Sequential(nn.Embedding(args.vocab, args.width), *[layer() for _ in range(half)])
    else:
        stage = nn.Sequential(*[layer() for _ in range(args.layers - half)], nn.Linear(args.width, args.vocab))
    stage = stage.to(device)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=3e-4)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    micro, shape = 4, (args.batch // 4, args.seq, args.width)
    loss_fn = nn.CrossEntropyLoss()
    started = time.monotonic()
    while True:
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            outputs = []
            for _ in range(micro):
                tokens = torch.randint(0, args.vocab, shape[:2], device=device)
                with autocast:
                    out = stage(tokens)
                dist.send(out.detach().float().contiguous(), 1)
                outputs.append(out)
            for out in outputs:
                grad = torch.empty(shape, device=device)
                dist.recv(grad, 1)
                out.float().backward(grad)
        else:
            inputs, losses = [], []
            for _ in range(micro):
                received = torch.empty(shape, device=device)
                dist.recv(received, 0)
                received.requires_grad_()
                with autocast:
                    logits = stage(received)
                target = torch.randint(0, args.vocab, shape[:2], device=device)
                losses.append(loss_fn(logits.reshape(-1, args.vocab).float(), target.reshape(-1)))
                inputs.append(received)
            for received, loss in zip(inputs, losses, strict=True):
                loss.backward()
                dist.send(received.grad.contiguous(), 0)
        optimizer.step()
        if _time_is_up(time.monotonic() - started > args.seconds, device, distributed):
            break
    _finish(device, distributed)


def decode(args: argparse.Namespace) -> None:
    """Inference decode: a GPT-2-medium-sized model (random weights, no download) in bf16 generates 256 tokens
    for a batch of 8 prompts with Hugging Face's generate(), greedy, with its KV cache; then the next batch."""
    from transformers import GPT2Config, GPT2LMHeadModel

    _, _, device, _ = _setup(args)
    config = GPT2Config(n_layer=24, n_embd=1024, n_head=16, vocab_size=args.vocab)
    model = GPT2LMHeadModel(config).to(device, torch.bfloat16 if args.precision == "bf16" else torch.float32).eval()
    started = time.monotonic()
    while time.monotonic() - started < args.seconds:
        prompts = torch.randint(0, args.vocab, (8, 128), device=device)
        with torch.inference_mode():
            model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=256, min_new_tokens=256,
                           do_sample=False, pad_token_id=0)  # fmt: skip
    _synchronize(device)


def elementwise(args: argparse.Namespace) -> None:
    """bf16 normalisation and activation kernels without matmul, forward and backward (a LayerNorm + softmax +
    GELU block over 64 M elements): the SMs are busy, the tensor cores idle."""
    _, _, device, _ = _setup(args)
    norm = nn.LayerNorm(4096).to(device, torch.bfloat16)
    x = torch.randn(16384, 4096, device=device, dtype=torch.bfloat16, requires_grad=True)
    started = time.monotonic()
    while time.monotonic() - started < args.seconds:
        for _ in range(10):
            y = torch.nn.functional.gelu(torch.softmax(norm(x), dim=-1) * 4096.0)
            y.sum().backward()
        _synchronize(device)


def fill(args: argparse.Namespace) -> None:
    """An idle holder: takes `--fill-share` of the GPU's free memory through PyTorch's allocator, touches it, and
    sleeps (a notebook kernel left open, a job stuck before its first step)."""
    _, _, device, _ = _setup(args)
    free, _ = torch.cuda.mem_get_info() if device.type == "cuda" else (2**32, None)
    chunk = 1 << 30
    held = []
    while sum(t.numel() for t in held) + chunk < free * args.fill_share:
        held.append(torch.ones(chunk, dtype=torch.uint8, device=device))
    print(f"holding {sum(t.numel() for t in held) / 2**30:.1f} GiB of {free / 2**30:.1f} GiB free", flush=True)
    time.sleep(args.seconds)


JOBS = {
    "transformer": transformer,
    "fsdp": transformer,
    "comm-heavy": comm_heavy,
    "allreduce": allreduce,
    "pipeline": pipeline,
    "decode": decode,
    "elementwise": elementwise,
    "fill": fill,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", choices=sorted(JOBS), default="transformer")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: try a job without a GPU (gloo)")
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
    parser.add_argument("--sample-cost", type=float, default=0.0, help="CPU seconds a loader worker spends per sample")
    parser.add_argument("--schedule", help="straggler injections, JSON lines a driver appends to (class Schedule)")
    parser.add_argument("--fill-share", type=float, default=0.95)
    args = parser.parse_args()
    JOBS[args.job](args)


if __name__ == "__main__":
    main()

"""The planner's CPU compute figures, measured on one thread (each of the benchmark's ranks has one): fp32 matmul
FLOP/s, fused attention FLOP/s, the byte rate of a transformer's elementwise ops, the time of one small eager op,
and AdamW's step. Each figure is the best of `--repeat` runs (the machine is shared: the best is the run the least
disturbed by other processes); the median is printed beside it.

    .venv/bin/python benchmarks/cpu_figures.py [--tokens 1024 --d-model 512 --heads 8 --seq 256] [--repeat 15]

Shapes default to one rank's share of the GPT of benchmarks/run.py (4 x 256 tokens, d 512); FLOPs and bytes are
counted as the planner counts them (torch's flop formulas, causal attention halved; bytes read + bytes written).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from fsdp2_compile._torch_private import log_softmax_backward


def best_and_median(fn, repeat: int) -> tuple[float, float]:
    """(best, median) seconds of `fn` over `repeat` runs after one warm-up."""
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples), statistics.median(samples)


def rate(work: float, fns, repeat: int) -> dict:
    """Work per second of running every fn once: best and median."""
    times = [best_and_median(fn, repeat) for fn in fns]
    return {"best": work / sum(t[0] for t in times), "median": work / sum(t[1] for t in times)}


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def matmul(tokens: int, d: int, repeat: int) -> dict:
    """A Linear's forward, input-gradient and weight-gradient matmuls at hidden d -> 4d and d -> d."""
    fns, work = [], 0.0
    for n in (4 * d, d):
        x, w, g = torch.randn(tokens, d), torch.randn(d, n), torch.randn(tokens, n)
        for a, b in ((x, w), (g, w.t()), (x.t(), g)):
            fns.append(lambda a=a, b=b: a @ b)
            work += 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return rate(work, fns, repeat)


def attention(tokens: int, d: int, heads: int, seq: int, repeat: int) -> dict:
    """Causal SDPA (the CPU flash kernel) forward + backward; FLOPs as the planner counts them (causal: half)."""
    q, k, v = (torch.randn(tokens // seq, heads, seq, d // heads, requires_grad=True) for _ in range(3))

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))

    shape = q.shape
    flops = sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape)
    return rate(flops / 2, [step], repeat)


def elementwise(tokens: int, d: int, heads: int, seq: int, repeat: int) -> dict:
    """Bytes read + written per second by the elementwise ops of a transformer block's forward and backward:
    residual add, GELU and its backward, LayerNorm and its backward, a transposed copy, log-softmax and its
    backward."""
    x, y, h, gh = torch.randn(tokens, d), torch.randn(tokens, d), torch.randn(tokens, 4 * d), torch.randn(tokens, 4 * d)
    w, b = torch.ones(d), torch.zeros(d)
    ln_out, mean, rstd = torch.native_layer_norm(x, (d,), w, b, 1e-5)
    logits = torch.randn(tokens, 4 * d)
    lsm = torch.log_softmax(logits, -1)
    t = x.view(tokens // seq, seq, heads, d // heads).transpose(1, 2)  # heads-major, as attention's output
    ops = [
        (lambda: x + y, nbytes(x, y, x)),
        (lambda: F.gelu(h), nbytes(h, h)),
        (lambda: torch.ops.aten.gelu_backward(gh, h), nbytes(gh, h, h)),
        (lambda: torch.native_layer_norm(x, (d,), w, b, 1e-5), nbytes(x, x, mean, rstd)),
        (
            lambda: torch.ops.aten.native_layer_norm_backward(y, x, (d,), mean, rstd, w, b, [True, True, True]),
            nbytes(y, x, mean, rstd, x),
        ),
        (lambda: t.contiguous(), nbytes(x, x)),
        (lambda: torch.log_softmax(logits, -1), nbytes(logits, logits)),
        (lambda: log_softmax_backward(gh, lsm, -1, torch.float32), nbytes(gh, lsm, gh)),
    ]
    return rate(sum(n for _, n in ops), [fn for fn, _ in ops], repeat)


def launch(repeat: int) -> dict:
    """Seconds per small eager op: 2,000 x `x + 1` on 16 elements."""
    x = torch.zeros(16)

    def many():
        for _ in range(2000):
            x + 1

    best, median = best_and_median(many, repeat)
    return {"best": best / 2000, "median": median / 2000}


def adamw(numel: int, repeat: int) -> dict:
    """AdamW's step (torch's default implementation on CPU) over one fp32 parameter of `numel`, as bytes per second
    of the planner's count: read parameter, gradient, two states; write parameter and two states."""
    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel)
    opt = torch.optim.AdamW([p], lr=1e-4)
    return rate(4 * numel * 7, [opt.step], repeat)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeat", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    figures = {
        "matmul_flops_per_s": matmul(args.tokens, args.d_model, args.repeat),
        "attention_flops_per_s": attention(args.tokens, args.d_model, args.heads, args.seq, args.repeat),
        "elementwise_bytes_per_s": elementwise(args.tokens, args.d_model, args.heads, args.seq, args.repeat),
        "launch_s": launch(args.repeat),
        "adamw_bytes_per_s": adamw(1 << 22, args.repeat),
    }
    print(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__, **figures}, indent=1))


if __name__ == "__main__":
    main()

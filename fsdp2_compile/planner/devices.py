"""What the planner assumes of each device, beside the cost model's link figures (`hardware.PROFILES`, which the
scheduler also uses and which stay as they are): peak FLOP/s, memory bandwidth, the fraction of each that an op
class reaches, per-op launch time, whether communication runs beside compute, and how an allocator's reserved
memory relates to the live bytes. Every figure carries its source; "calibrated" figures were fitted on one
published run only (named), everything else is checked against, never fitted to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DEVICES", "DeviceFigures", "device_for"]


@dataclass(frozen=True)
class DeviceFigures:
    peak_flops: float
    """Dense FLOP/s of one rank in the compute dtype (the MFU denominator)."""
    mem_bytes_per_s: float
    """Memory bandwidth of one rank."""
    efficiency: dict[str, float]
    """Fraction of peak reached by op class: "matmul", "attention" (of peak_flops), "memory" (of bandwidth:
    elementwise ops) and optionally "optimizer" (of bandwidth: the AdamW step; "memory" where absent)."""
    launch_s: float
    """Fixed time per op (kernel launch / eager dispatch)."""
    comm_overlaps_compute: bool
    """Whether a collective in flight progresses while the rank computes."""
    allocator_factor: float
    """Reserved (what the device reports) / allocated (live tensors) at the peak."""
    runtime_bytes: int
    """Memory a process holds before any tensor (runtime, libraries, CUDA context)."""
    intra_node_bytes_per_s: float = 0.0
    """Bandwidth of the link between ranks of one node, bytes/s each rank sends (tensor parallelism's collectives
    run on it: TP inside a node, FSDP across)."""
    intra_node_alpha_s: float = 0.0
    """Fixed cost of one collective on the intra-node link."""
    reduce_scatter_factor: float = 1.0
    """A reduce-scatter's link time over a ring's (N-1)/N of its full buffer (a ring: 1; an all-reduce: 2)."""
    float8_flops: float = 0.0
    """Dense float8 FLOP/s of one rank (float8 training's Linear matmuls run at it x the matmul efficiency); 0: the
    device has no float8 matmul."""
    sources: dict[str, str] = field(default_factory=dict)


_H100 = DeviceFigures(
    peak_flops=989e12,
    mem_bytes_per_s=2.4e12,
    efficiency={"matmul": 0.459, "attention": 0.34, "memory": 0.8},
    launch_s=5e-6,
    comm_overlaps_compute=True,
    allocator_factor=1.159,
    runtime_bytes=int(0.5 * 2**30),
    intra_node_bytes_per_s=360e9,
    intra_node_alpha_s=15e-6,
    float8_flops=1979e12,
    sources={
        "intra_node_bytes_per_s": "NVLink 4 on H100 SXM: 450 GB/s per direction (NVIDIA H100 datasheet, 900 GB/s "
        "bidirectional) x 0.8 assumed; as cost_model h100-nvlink (not measured here)",
        "intra_node_alpha_s": "as cost_model h100-nvlink: 15 us per collective (assumed)",
        "peak_flops": "NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16",
        "float8_flops": "NVIDIA H100 SXM datasheet: 1,979 TFLOP/s dense FP8 (2x bf16); float8 matmuls assumed to "
        "reach the same fraction of it as bf16 ones (efficiency.matmul), plus torchao's scaling casts as memory "
        "passes (step_model._float8_cast_s); not fitted: checked against torchtitan's float8 rows",
        "mem_bytes_per_s": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Hardware: 96 GB HBM2e, "
        "2.4 TB/s (Grand Teton, 500 W)",
        "efficiency.matmul": "calibrated: torchtitan Table 1 'FSDP' row (Llama 3.1 8B, 8 GPUs, local batch 2, "
        "seq 8192, selective op AC, eager): 5,762 tokens/s per GPU",
        "efficiency.attention": "FlashAttention-2 paper (Dao 2023, Fig. 7): ~335 TFLOP/s causal fwd+bwd, head dim "
        "128, on H100 SXM5 = 0.34 of peak",
        "efficiency.memory": "assumed 0.8 of the HBM bandwidth (elementwise kernels)",
        "launch_s": "assumed: ~5 us per CUDA kernel launch in eager mode",
        "comm_overlaps_compute": "NCCL runs on its own CUDA stream",
        "reduce_scatter_factor": "NCCL's ring reduce-scatter sends (N-1)/N of the buffer (assumed 1)",
        "allocator_factor": "calibrated: torchtitan Table 1 'FSDP' row: 82.4 GiB reserved peak",
        "runtime_bytes": "assumed: ~0.5 GiB of CUDA context and NCCL buffers",
    },
)

_CPU_BENCH = (
    "measured by benchmarks/cpu_figures.py --repeat 40 on the 2-core CI machine, one thread as each rank "
    "has, 2026-11-30: best of 40 runs, highest of 3 invocations (the machine was shared; the medians were "
    "0.5-0.9x the best)"
)
_CPU = DeviceFigures(
    peak_flops=97e9,
    mem_bytes_per_s=19e9,
    efficiency={"matmul": 1.0, "attention": 0.36, "memory": 1.0, "optimizer": 0.66},
    launch_s=2.7e-6,
    comm_overlaps_compute=False,
    allocator_factor=1.45,
    runtime_bytes=401 * 2**20,
    intra_node_bytes_per_s=0.38e9,
    intra_node_alpha_s=500e-6,
    sources={
        "intra_node_bytes_per_s": "cost_model cpu-gloo-loopback: measured gloo bandwidth over loopback between "
        "ranks on this machine (0.36-0.40 GB/s)",
        "intra_node_alpha_s": "cost_model cpu-gloo-loopback: measured 0.46-0.58 ms per collective",
        "peak_flops": f"{_CPU_BENCH}: fp32 matmul 97 GFLOP/s at a GPT Linear's shapes (1024 tokens, d 512 -> "
        "2048 and 512 -> 512: forward, input and weight gradients); sustained, so efficiency 1.0",
        "mem_bytes_per_s": f"{_CPU_BENCH}: 19 GB/s read + written by a transformer's elementwise ops (add, GELU and "
        "backward, LayerNorm and backward, transposed copy, log-softmax and backward)",
        "efficiency.attention": f"{_CPU_BENCH}: causal SDPA (CPU flash kernel) forward + backward at 4 x 8 heads x "
        "256 x 64, 35 GFLOP/s counting causal FLOPs = 0.36 of the matmul rate",
        "efficiency.optimizer": f"{_CPU_BENCH}: torch's AdamW step on a 4M-element parameter, 12.5 GB/s of the "
        "planner's count (read parameter, gradient, 2 states; write parameter, 2 states) = "
        "0.66 of the elementwise rate (runs ranged 4.7-12.5 GB/s: it is the figure the other "
        "processes disturb most)",
        "launch_s": f"{_CPU_BENCH}: 2.7 us per small eager op (2,000 x `x + 1` on 16 elements)",
        "reduce_scatter_factor": "not resolved on loopback, where link time is CPU copies: benchmarks/"
        "link_figures.py gave a reduce-scatter 1.08-2.12x an all-gather (an all-reduce "
        "0.73-0.83x) with the machine loaded; left at a ring's 1",
        "comm_overlaps_compute": "assumed False, the link time added to compute: on the 2-core machine otherwise idle "
        "(2026-12-04) a 2-rank step of the benchmark GPT over loopback takes 1.12x one rank's compute alone "
        "(the plan: 1.21x), though benchmarks/gloo_overlap_probe.py finds a lone all-gather progressing beside "
        "matmuls (24 MiB: 0.066 s alone, 0.301 s beside 0.3 s of matmuls); what else makes "
        "the excess was not identified",
        "allocator_factor": "measured by benchmarks/rss_figures.py (2 ranks, full pipeline, one thread each, "
        "2026-11-30) on the 4-layer d 384 GPT: (peak RSS with glibc's default - the runtime) / "
        "the live tensor peak (c10 allocator, torch.profiler) = 1.45-1.46 (2-layer d 256: "
        "1.30-1.52; the 8-layer d 512 of the benchmark: 1.57-1.61). What glibc keeps: its mmap "
        "threshold rises to the largest block freed (up to 32 MiB), after which freed tensors stay "
        "in the heap, fragmented; with MALLOC_MMAP_THRESHOLD_=131072 the factor is 0.84-0.98",
        "runtime_bytes": "measured here 2026-11-30: peak RSS of a 1-rank gloo process that trains a 2-layer d=64 GPT "
        "(tensors < 1 MiB) for 3 AdamW steps with shard_compile: 401 MiB (fully_shard eager: 317 "
        "MiB); of it 220 MiB after import torch, gloo init and import fsdp2_compile, the rest "
        "compiled graphs and their code. benchmarks/rss_figures.py with a fixed mmap threshold "
        "(RSS after a step - live tensors) gives 386 / 400 / 426 MiB for 2-, 4- and 8-layer GPTs",
    },
)

DEVICES: dict[str, DeviceFigures] = {
    "cpu-gloo-loopback": _CPU,
    "cpu-gloo-1gbit": DeviceFigures(
        **{
            **_CPU.__dict__,
            "comm_overlaps_compute": True,
            "reduce_scatter_factor": 2.0,
            "sources": {
                **_CPU.sources,
                "comm_overlaps_compute": "measured here (benchmarks/gloo_overlap_probe.py): "
                "on the 1 Gbit/s link a started all-gather progresses while the rank computes",
                "reduce_scatter_factor": "measured by benchmarks/link_figures.py on the benchmark's 1 Gbit/s "
                "link, 2 ranks, 2026-11-30: gloo's reduce-scatter of a 32 MiB buffer takes 1.94-1.99x the "
                "all-gather of it (an all-reduce: 1.79-1.84x), so 2",
            },
        }
    ),
    "h100-nvlink": _H100,
    "h100-infiniband": _H100,
}


def device_for(profile_name: str) -> DeviceFigures:
    """The planner's figures for a cost-model profile (a measured profile: the CPU figures)."""
    return DEVICES.get(profile_name, _CPU)

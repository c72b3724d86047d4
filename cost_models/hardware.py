"""Hardware tables: GPU and cluster presets, each number with its source.

Datasheet figures come from `shared/reference/gpu_specs.json` (which cites NVIDIA datasheets and whitepapers).
Calibration constants (`GPUCalibration`, `LinkSpec.efficiency`) are fitted once per GPU type or link type
against the published runs in `shared/reference/calibration_runs.json` by `benchmarks/fidelity.py`; they are
never tuned per run.
"""

from __future__ import annotations

from .errors import SpecError
from .specs import ClusterSpec, GPUCalibration, GPUSpec, LinkSpec, PeakTFlops

GIB = 1024**3

# Ampere calibration: fitted by benchmarks/calibrate_fit.py on the ten SC21 Table 1 runs at once
# (A100-80GB, fp16, Megatron-LM 2021). A 70% ceiling for fp16 GEMMs is consistent with cuBLAS on A100
# (~220 of 312 TF/s on large square GEMMs); the attention efficiency is not exercised by those runs
# (unfused softmax), so it keeps the FlashAttention-2 paper's A100 figure.
# Refitted in session 36 after the 1.7B-18B runs got the torch DDP their script ran (overlapped all-reduce):
# SC21 2.19% / 5.40% (old constants, corrected inputs 2.46% / 5.40%) -> 1.68% / 5.19%.
_AMPERE = GPUCalibration(
    matmul_max_efficiency=0.7435,  # ~232 of 312 TF/s, within cuBLAS's large fp16 GEMMs on A100 (220-250)
    matmul_half_dim=202.5,
    attention_efficiency=0.45,  # FlashAttention-2 fwd+bwd on A100 ~ 50-70% of peak (Dao 2023), causal lower
    memory_efficiency=0.7922,  # fitted; ~1.6 of 2.0 TB/s, as STREAM-like copies reach on A100-80GB
    kernel_launch_us=4.0,  # host time per kernel; Megatron 2021 layers are GPU-bound at these sizes
    framework_overhead_gib=2.5,
)
# Hopper calibration: fitted by benchmarks/calibrate_fit.py on the nine Megatron-LM README H100 runs at once
# (bf16, Megatron-Core r0.8.0 with Transformer Engine).
_HOPPER = GPUCalibration(
    matmul_max_efficiency=0.680,  # ~670 of 989 TF/s for large bf16 GEMMs, as cuBLAS reaches on H100 SXM
    matmul_half_dim=275.0,
    attention_efficiency=0.260,  # executed FLOPs of causal flash attention, fwd; bwd is 2.5x the fwd work
    memory_efficiency=0.878,  # H100 copy kernels reach ~2.9 of 3.35 TB/s
    # Host time per counted kernel (~0.8 ms per GPT block forward): Megatron-Core + Transformer Engine run
    # eagerly from Python, which is why small models are host-bound there (the reason MCore later added
    # CUDA graphs).
    kernel_launch_us=67.4,
    # autoplan's own runtime (priced only for its stack, compute.layer_cost), measured on an H200's host:
    # a fused Triton module's forward call against the eager op it replaces, host time per call (session 12,
    # benchmarks/gpu/launch_overhead.py at 4096 tokens x 2048: LayerNorm 145.7 against 21.5 us, RMSNorm 122.6 /
    # 22.1, GeLU 79.1 / 15.0, SwiGLU 93.3 / 24.5; the mean of the four differences)
    fused_call_us=89.4,
    # torch.utils.checkpoint's host time per region and per operator in it (session 17, `autoplan calibrate
    # --bench-out` on the H200: tiny-gpt's attention core, 1 operator, 992 us; its block, 12 operators, 1,711 us)
    recompute_region_us=926.9,
    recompute_op_us=65.3,
    framework_overhead_gib=3.0,
)
# Blackwell: no published end-to-end run in the reference data; Hopper's efficiencies are assumed.
_BLACKWELL = _HOPPER


GPU_PRESETS: dict[str, GPUSpec] = {
    # A100 SXM4: 312 TF/s fp16/bf16 dense, 156 tf32, 19.5 fp32 (A100 datasheet r4 via gpu_specs.json);
    # 40 GB HBM2 at 1,555 GB/s (A100 datasheet); usable 40 GiB (nvidia-smi reports 40,960 MiB).
    "a100-40g": GPUSpec(
        name="a100-40g",
        peak_tflops=PeakTFlops(**{"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
        hbm_gib=40,
        hbm_gbps=1555,
        calibration=_AMPERE,
    ),
    # A100 SXM4 80GB: 80 GB HBM2e at 2,039 GB/s (gpu_specs.json); nvidia-smi reports 81,920 MiB = 80 GiB.
    "a100-80g": GPUSpec(
        name="a100-80g",
        peak_tflops=PeakTFlops(**{"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
        hbm_gib=80,
        hbm_gbps=2039,
        calibration=_AMPERE,
    ),
    # H100 SXM5: 989.4 TF/s bf16/fp16 dense, 1978.9 fp8, 494.7 tf32, 66.9 fp32 (Hopper whitepaper via
    # gpu_specs.json); 80 GB HBM3 at 3,350 GB/s; nvidia-smi reports 81,559 MiB = 79.6 GiB.
    "h100-sxm": GPUSpec(
        name="h100-sxm",
        peak_tflops=PeakTFlops(**{"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9}),
        hbm_gib=79.6,
        hbm_gbps=3350,
        calibration=_HOPPER,
    ),
    # H200 SXM: same GH100 compute as H100; 141 GB HBM3e at 4,800 GB/s (gpu_specs.json); 143,771 MiB = 140.4 GiB.
    "h200": GPUSpec(
        name="h200",
        peak_tflops=PeakTFlops(**{"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9}),
        hbm_gib=140.4,
        hbm_gbps=4800,
        calibration=_HOPPER,
    ),
    # B200 (HGX, 1000 W): 2,250 TF/s bf16 dense, 4,500 fp8, 1,100 tf32 (gpu_specs.json, unverified against
    # NVIDIA's datasheet); 8.0 TB/s; ~179 GB usable per nvidia-smi (gpu_specs.json) = 166.7 GiB.
    "b200": GPUSpec(
        name="b200",
        peak_tflops=PeakTFlops(**{"bf16": 2250, "fp16": 2250, "fp8": 4500, "tf32": 1100, "fp32": 80}),
        hbm_gib=166.7,
        hbm_gbps=8000,
        calibration=_BLACKWELL,
    ),
    # This machine's CPU seen as a "GPU" for the gloo demo, per process when 4 processes share 2 cores:
    # `autoplan calibrate` measured ~0.1 TF/s fp32 matmul on one core with one thread and ~3-10 GB/s copy
    # bandwidth; halved for two processes per core. 24 GiB of RAM shared by 4 processes gives 6 GiB each.
    "cpu": GPUSpec(
        name="cpu",
        peak_tflops=PeakTFlops(**{"fp32": 0.05, "bf16": 0.01, "fp16": 0.01}),
        hbm_gib=6,
        hbm_gbps=3,
        calibration=GPUCalibration(
            matmul_max_efficiency=0.8,
            matmul_half_dim=27.0,  # measured by `autoplan calibrate` (rate at n=128 vs the best)
            attention_efficiency=0.3,
            memory_efficiency=0.8,
            # eager PyTorch with autograd, host time per operator: 9.5 us measured on this CPU (tiny-gpt's
            # forward + backward at one token, one process: docs/notes/session-10/host_ops.py; `autoplan
            # calibrate` measures ~5 us for a bare op), doubled by two processes per core
            kernel_launch_us=20.0,
            # torch.utils.checkpoint's host time per checkpointed region, beyond re-running its operators:
            # ~195 us per region plus ~35 us per operator in it (saved-tensor hooks) in one process,
            # doubled by two processes per core. Measured 2026-11-26 (session 9) with
            # `OMP_NUM_THREADS=1 python -c "from autoplan.calibrate_bench import bench_recompute_region as b;
            # print(b('cpu'))"` (tiny-gpt's attention core, 1 op: 226-231 us; its block, 12 ops: 595-619 us),
            # which matches the runs: dp=1 mbs=1 (1 process, 32 regions a step) costs +12 ms selective, +30 ms
            # full over no recompute (~375 and ~940 us per region, the re-run forward included).
            recompute_region_us=390.0,
            recompute_op_us=70.0,
            # DTensor's sharding propagation and dispatch per operator of a tensor-parallel layer: 54-62 us in
            # one process (the runtime's tp layout on a one-process mesh against the plain model, tiny-gpt at one
            # token: `autoplan.calibrate_bench.bench_tp_ops`, session 15), doubled by two processes per core.
            # `autoplan tune` fits 250-300 here, which also holds what the tensor-parallel collectives' host
            # work costs beyond their latency.
            tp_op_overhead_us=120.0,
            # the optimizer step over DTensor parameters, per tensor beyond a plain one: 10.8-11.0 us in one process
            # (tiny-gpt's 68 tensors FSDP2-sharded on a one-process mesh against plain, the runtime's fused AdamW:
            # `autoplan.calibrate_bench.bench_tp_ops`, session 16), doubled by two processes per core
            dtensor_param_us=22.0,
            # torch.distributed.pipelining's host time per action (one stage's forward or backward of one micro-
            # batch) beyond the stage's operators: 87-103 us of the main thread's CPU in 1F1B, 95-187 in GPipe, two
            # processes with a core each (`autoplan.calibrate_bench.bench_pipeline_actions`, session 19), doubled
            # by two processes per core
            pipeline_action_us=190.0,
            framework_overhead_gib=0.5,
            overlap_interference=1.0,  # gloo runs on the same cores as the compute: nothing is hidden
        ),
    ),
}

# Network levels. NVLink bandwidths are per GPU per direction (half the datasheet's bidirectional figure);
# InfiniBand is one NIC per GPU. Efficiencies are bus-bandwidth fractions reached by NCCL on large messages.
_NVLINK3 = LinkSpec(bandwidth_gbps=300, latency_us=3, efficiency=0.78)  # A100: 600 GB/s bidirectional
_NVLINK4 = LinkSpec(bandwidth_gbps=450, latency_us=3, efficiency=0.80)  # H100/H200: 900 GB/s bidirectional
_NVLINK5 = LinkSpec(bandwidth_gbps=900, latency_us=3, efficiency=0.80)  # B200: 1.8 TB/s bidirectional
_HDR_IB = LinkSpec(bandwidth_gbps=25, latency_us=5, efficiency=0.85)  # 200 Gb/s HDR, one per GPU (SC21 §5)
_NDR_IB = LinkSpec(bandwidth_gbps=50, latency_us=5, efficiency=0.85)  # 400 Gb/s NDR ConnectX-7, one per GPU


def _dgx(name: str, gpu: str, intra: LinkSpec, inter: LinkSpec, nodes: int) -> ClusterSpec:
    return ClusterSpec(
        name=name, gpu=GPU_PRESETS[gpu], gpus_per_node=8, num_nodes=nodes, intra_node=intra, inter_node=inter
    )


CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    # DGX A100 80GB SuperPOD as in SC21 (Selene): 8 GPUs/node, NVSwitch, 8x HDR 200 Gb/s per node.
    "dgx-a100-80g": _dgx("dgx-a100-80g", "a100-80g", _NVLINK3, _HDR_IB, 128),
    "dgx-a100-40g": _dgx("dgx-a100-40g", "a100-40g", _NVLINK3, _HDR_IB, 128),
    # DGX H100: NVLink4 via NVSwitch, 8x ConnectX-7 400 Gb/s (DGX BasePOD reference architecture).
    "dgx-h100": _dgx("dgx-h100", "h100-sxm", _NVLINK4, _NDR_IB, 128),
    "dgx-h200": _dgx("dgx-h200", "h200", _NVLINK4, _NDR_IB, 128),
    # DGX B200: NVLink5, 8x ConnectX-7 400 Gb/s (DGX BasePOD reference architecture).
    "dgx-b200": _dgx("dgx-b200", "b200", _NVLINK5, _NDR_IB, 128),
    # This machine: 4 gloo processes on 2 cores; all-reduce ~0.5 GB/s, 0.3-0.5 ms latency (DESIGN.md).
    "local-cpu": ClusterSpec(
        name="local-cpu",
        gpu=GPU_PRESETS["cpu"],
        gpus_per_node=4,
        num_nodes=1,
        # gloo over loopback: ~0.3-0.5 GB/s; latency ~0.2 ms per hop measured with 2 processes
        # (`autoplan calibrate`), ~1 ms with 4 processes on 2 cores (each hop waits for a descheduled peer)
        intra_node=LinkSpec(bandwidth_gbps=0.4, latency_us=1000, efficiency=1.0),
        inter_node=LinkSpec(bandwidth_gbps=0.4, latency_us=1000, efficiency=1.0),
        backend="gloo",
    ),
}


def gpu_preset(name: str) -> GPUSpec:
    key = name.lower()
    if key not in GPU_PRESETS:
        raise SpecError(f"unknown GPU {name!r}", "", "known GPUs: " + ", ".join(GPU_PRESETS))
    return GPU_PRESETS[key]


def cluster_preset(name: str) -> ClusterSpec:
    key = name.lower()
    if key not in CLUSTER_PRESETS:
        raise SpecError(
            f"unknown cluster {name!r}", "", "known clusters: " + ", ".join(CLUSTER_PRESETS) + ", or a YAML file"
        )
    return CLUSTER_PRESETS[key]

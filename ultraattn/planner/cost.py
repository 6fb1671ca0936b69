"""Cost model: how long a kernel, a message or a merge takes.

This is a measuring instrument, not a knob: the defaults come from public H100 figures
(cited per field) and are never tuned to make a plan look good. Override any field with
``dataclasses.replace(DEFAULT_COST, ...)`` or ``CostModel(**{...})``; the CLI's
``--cost key=value`` does the same.

Model:
    kernel time   = launches * launch + flops / (peak * eff),  eff = L / (L + L_half)
                    L = average non-empty KV tokens per query block row of the kernel:
                    short inner loops pay the pipeline prologue/epilogue (small tiles
                    run slower); PARTIAL blocks cost ``1 + partial_block_overhead``
                    FULL blocks (the mask is evaluated, nothing is skipped inside);
                    the runtime launches once per query row of a plan kernel.
    message time  = latency + bytes / bandwidth  (intra-node NVLink or inter-node NIC)
    merge time    = bytes touched / bandwidth (the LSE merge of outputs, or a gradient sum)
Backward work is 2.5x the forward FLOPs (5 matmuls against 2, FlashAttention-2 paper).

The H100 defaults are for planning a machine you are not on. On the machine itself,
``ultraattn calibrate`` (``cost="auto"``) fits these fields to measurements
(``planner/profile.py``, ``runtime/calibrate.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """Hardware parameters (defaults: H100 SXM, NVLink4, one 400 Gb/s NDR NIC per GPU)."""

    fwd_tflops: float = 680.0
    """Forward attention rate on long tiles, TFLOP/s. FlashAttention-3 (Shah et al. 2024, Fig. 5):
    bf16, head dim 128, H100 SXM reaches ~620-680 TFLOP/s at 4K-16K tokens."""
    bwd_tflops: float = 560.0
    """Backward rate, TFLOP/s. FlashAttention-3 (Fig. 6): bf16 backward, head dim 128,
    ~450-560 TFLOP/s at 4K-16K."""
    eff_half_tokens: float = 400.0
    """L_half of eff = L/(L+L_half), in KV tokens per query block. Fitted to the same FA3 curves
    (~55% of peak at 512 tokens, ~72% at 1K, ~90% at 4K)."""
    partial_block_overhead: float = 0.10
    """Extra cost of a PARTIAL block over a FULL one (mask evaluated per element). FlexAttention
    (PyTorch blog, Aug 2024) runs masked variants at ~90% of FlashAttention-2's rate."""
    launch_us: float = 5.0
    """Kernel launch + scheduling overhead per launch, microseconds (CUDA launch latency ~3-5 us)."""
    intra_bw_GBps: float = 360.0
    """Intra-node point-to-point bandwidth per GPU and direction, GB/s: 80% of NVLink4's 450 GB/s
    per direction (H100 SXM datasheet: 900 GB/s bidirectional), the share NCCL reaches."""
    inter_bw_GBps: float = 45.0
    """Inter-node bandwidth per GPU and direction, GB/s: one ConnectX-7 NDR 400 Gb/s NIC per GPU
    (DGX H100) = 50 GB/s line rate, ~90% achieved by RDMA writes."""
    intra_latency_us: float = 5.0
    """Per-message latency inside a node (NCCL p2p over NVLink), microseconds."""
    inter_latency_us: float = 12.0
    """Per-message latency across nodes (NCCL over InfiniBand), microseconds."""
    hbm_GBps: float = 3000.0
    """HBM3 bandwidth for merges, GB/s (H100 SXM datasheet: 3.35 TB/s peak): partial gradient sums (dq, dk/dv)."""
    lse_merge_GBps: float = 3000.0
    """Bytes per second of the forward's log-sum-exp merge of partial outputs (max, exp, rescale, add: several
    elementwise passes where a sum makes one). Default: the HBM figure (not measured on an H100); on a CPU the
    calibration measured it ~7x slower per byte than a sum."""
    bwd_flops_factor: float = 2.5
    """Backward FLOPs over forward FLOPs (FlashAttention-2: 5 matmuls vs 2)."""
    alone_speedup: float = 1.0
    """How much faster a rank computes while the other ranks of its node wait than while all compute: 1 where each
    rank has its own device (GPUs); about ranks / cores where ranks share CPU cores (4 gloo ranks on 2 cores: 2).
    Kernel rates are the all-busy rates; the simulator shares a node's compute among the ranks computing at the
    time (``schedule.SharedCompute``). Measured by ``ultraattn calibrate``."""
    async_kernels: float = 1.0
    """1 where the host thread only enqueues a kernel and goes on (CUDA): the executor posts a relayed unit on a
    communication stream that does not wait for the compute stream (``runtime/streams.py``). 0 where the host thread
    runs each kernel to its end (CPU ranks): whatever the host posts after a launch leaves after that launch. Only
    the replay as executed reads it (``program.executed_graph``); ``ultraattn calibrate`` sets it by device."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not v > 0 and f.name not in ("partial_block_overhead", "async_kernels"):
                raise ValueError(f"cost model field {f.name} must be positive, got {v}")
        if self.partial_block_overhead < 0:
            raise ValueError(f"partial_block_overhead must be >= 0, got {self.partial_block_overhead}")
        if self.async_kernels not in (0, 1):
            raise ValueError(f"async_kernels must be 0 (CPU ranks: the host runs each kernel) or 1 (GPUs), got "
                             f"{self.async_kernels}")
        if self.alone_speedup < 1:
            raise ValueError(f"alone_speedup must be >= 1 (a rank is never slower alone), got {self.alone_speedup}")

    # ------------------------------------------------------------------ kernels
    def kernel_seconds(self, *, flops: float, kv_tokens_per_row: float, phase: str, launches: float = 1) -> float:
        """Time of a kernel doing ``flops`` (forward-equivalent FLOPs for fwd) in ``launches`` launches (the runtime
        launches once per query row of a plan kernel)."""
        if flops <= 0:
            return 0.0
        return self._launch_seconds(flops, kv_tokens_per_row, phase, launches)

    def kernel_seconds_array(self, *, flops, kv_tokens_per_row, phase: str, launches=1):
        """``kernel_seconds`` of many kernels at once (numpy arrays; 0 where ``flops`` is 0)."""
        import numpy as np

        flops = np.asarray(flops, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            sec = self._launch_seconds(flops, np.asarray(kv_tokens_per_row, dtype=np.float64), phase,
                                       np.asarray(launches, dtype=np.float64))
        return np.where(flops > 0, sec, 0.0)

    def blocks_seconds(self, blocks, nonempty, rows, *, block: int, head_dim: int, rows_per_chunk: float, phase: str):
        """Seconds of plan kernels (numpy arrays, one entry per kernel) from their cells: ``blocks`` cost-weighted and
        ``nonempty`` (block x block) blocks over ``rows`` distinct query chunks of ``rows_per_chunk`` block rows each.
        One launch per query chunk (the runtime launches once per query row of a plan kernel:
        runtime/executor.py, ``RankProgram.rows``), at the efficiency of the keys per block row; 0 for a kernel with
        no block. The simulator (``schedule.Workload``) and the closed-form price (``price.Kernels``) both use it."""
        import numpy as np

        rows = np.maximum(rows, 1)
        return self.kernel_seconds_array(flops=blocks * block_flops(block, block, head_dim, 1, 1),
                                         kv_tokens_per_row=nonempty * block / (rows * rows_per_chunk), phase=phase,
                                         launches=rows)

    def _launch_seconds(self, flops, kv_tokens_per_row, phase: str, launches):
        """launches * launch + flops / (rate * eff): the formula both ``kernel_seconds`` forms share."""
        eff = kv_tokens_per_row / (kv_tokens_per_row + self.eff_half_tokens)
        if phase == "fwd":
            rate = self.fwd_tflops
        else:
            rate = self.bwd_tflops
            flops = flops * self.bwd_flops_factor
        return launches * self.launch_us * 1e-6 + flops / (rate * 1e12 * eff)

    # ------------------------------------------------------------------ messages
    def message_seconds(self, nbytes: int, *, inter_node: bool) -> float:
        if inter_node:
            return self.inter_latency_us * 1e-6 + nbytes / (self.inter_bw_GBps * 1e9)
        return self.intra_latency_us * 1e-6 + nbytes / (self.intra_bw_GBps * 1e9)

    def merge_seconds(self, nbytes, *, lse: bool = False):
        """Merging partials that touch ``nbytes`` (floats or arrays): the forward's LSE merge (``lse``) or a sum."""
        return nbytes / ((self.lse_merge_GBps if lse else self.hbm_GBps) * 1e9)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


DEFAULT_COST = CostModel()


def block_flops(q_block: int, kv_block: int, head_dim: int, heads: int, batch: int) -> float:
    """Forward FLOPs of one FULL (q_block x kv_block) block: QK^T and PV, 2 FLOPs per MAC."""
    return 4.0 * q_block * kv_block * head_dim * heads * batch

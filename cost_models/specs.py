"""Model and hardware specs, and their YAML presets (the workload: ``workload.py``).

Specs are data: the presets live in ``cost_models/presets/{models,hardware}``
as YAML files, and a user can pass the path of a file of the same shape
instead of a preset name.  Loading validates every key and raises
:class:`SpecError` (a ``ValueError``) naming the file, the key and what is
allowed.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import numpy as np

from search_spaces.typed import InputError, did_you_mean, from_mapping, show
from search_spaces.yaml_file import read_yaml

from . import hf_config

PRESET_DIR = Path(__file__).parent / "presets"


class SpecError(InputError):
    """A spec name, file or key that cannot be used."""


# range rules read by search_spaces.typed.from_mapping (field metadata)
_POSITIVE = {"min": 1}                     # an integer >= 1
_COUNT = {"min": 0}                        # an integer (or number) >= 0
MAX_WIDTH = 2 ** 24                        # the widest tensor dimension a spec may give (16,777,216)
MAX_LAYERS = 4096                          # the deepest published models have ~130 layers
_WIDTH = {"min": 1, "max": MAX_WIDTH}
_WIDTH_OR_0 = {"min": 0, "max": MAX_WIDTH}
_POSITIVE_OPEN = {"min": 0, "open": "left"}  # a number > 0
_NONEMPTY = {"nonempty": True}


# --------------------------------------------------------------------------- model
@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer (dense, or mixture-of-experts).

    Dense FFN layers use ``ffn_hidden``; MoE layers use ``n_experts`` routed
    experts of width ``moe_ffn_hidden`` (``top_k`` active per token) plus
    ``n_shared_experts`` always-active experts of the same width.  The first
    ``n_dense_layers`` layers of an MoE model are dense.  ``attention: mla``
    (DeepSeek multi-head latent attention) is described by the ``*_lora_rank``
    and ``*_head_dim`` keys; ``gqa`` by ``n_kv_heads`` and ``head_dim``.
    """

    name: str = field(metadata=_NONEMPTY)
    dim: int = field(metadata=_WIDTH)
    n_layers: int = field(metadata={"min": 1, "max": MAX_LAYERS})
    n_heads: int = field(metadata=_WIDTH)
    vocab_size: int = field(metadata=_WIDTH)
    ffn_hidden: int = field(metadata=_WIDTH)
    n_kv_heads: int = field(default=0, metadata=_WIDTH)   # not given -> n_heads (MHA)
    head_dim: int = field(default=0, metadata=_WIDTH)     # not given -> dim // n_heads
    mlp: Literal["swiglu", "gelu"] = "swiglu"                # swiglu: 3 matrices, gelu: 2
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    tie_embeddings: bool = False
    # a norm on the embedding output (BLOOM: Megatron-DeepSpeed's --embed-layernorm, a torch.nn.LayerNorm after the
    # vocab-parallel embedding's all-reduce, megatron/mpu/layers.py); the cost model counts what it keeps for
    # backward on the embedding's rank (cost_models/activations.embedding_activation_bytes); titan-run's
    # models have no embedding norm
    embed_norm: bool = False
    # multi-token prediction (DeepSeek-V3, arXiv:2412.19437 Sec. 2.2; Megatron-core's mtp_num_layers): each of the
    # mtp_layers modules is one more block of the last layer's kind, a [2h -> h] projection of the RMSNorm'd hidden
    # state and next-token embedding (two norms) and its own final norm before the shared LM head, with one more
    # cross-entropy, on the pipeline stage holding the head (Megatron-Bridge's DeepSeek-V3 layout 'Et|(tt|)*30mL');
    # the cost model charges them (cost_models.layout.rank_params, step_time.stage_times); titan-run's models have none
    mtp_layers: int = field(default=0, metadata={"min": 0, "max": 16})
    rope_theta: float = field(default=500000.0, metadata=_POSITIVE_OPEN)
    norm_eps: float = field(default=1e-5, metadata=_POSITIVE_OPEN)
    max_seq_len: int = field(default=8192, metadata=_POSITIVE)
    # RoPE frequency scaling: none, or Llama 3.1's (rope_type llama3; HF rope_scaling factor, low/high_freq_factor,
    # original_max_position_embeddings): wavelengths above original/low are divided by factor, below original/high
    # kept, blended between (executor/models/layers.py llama3_inv_freq)
    rope_scaling: Literal["none", "llama3"] = "none"
    rope_factor: float = field(default=8.0, metadata=_POSITIVE_OPEN)
    rope_low_freq_factor: float = field(default=1.0, metadata=_POSITIVE_OPEN)
    rope_high_freq_factor: float = field(default=4.0, metadata=_POSITIVE_OPEN)
    rope_original_max_seq_len: int = field(default=8192, metadata=_POSITIVE)
    # attention flavour
    attention: Literal["gqa", "mla"] = "gqa"
    q_lora_rank: int = field(default=0, metadata=_WIDTH_OR_0)
    kv_lora_rank: int = field(default=0, metadata=_WIDTH_OR_0)
    qk_nope_head_dim: int = field(default=0, metadata=_WIDTH_OR_0)
    qk_rope_head_dim: int = field(default=0, metadata=_WIDTH_OR_0)
    v_head_dim: int = field(default=0, metadata=_WIDTH_OR_0)
    # mixture of experts
    n_experts: int = field(default=0, metadata=_WIDTH_OR_0)
    top_k: int = field(default=0, metadata=_WIDTH_OR_0)
    moe_ffn_hidden: int = field(default=0, metadata=_WIDTH_OR_0)
    n_shared_experts: int = field(default=0, metadata=_WIDTH_OR_0)
    n_dense_layers: int = field(default=0, metadata={"min": 0, "max": MAX_LAYERS})
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    route_norm: bool = True
    route_scale: float = field(default=1.0, metadata=_POSITIVE_OPEN)
    aux_loss_coef: float = field(default=0.0, metadata=_COUNT)
    load_balance_bias: bool = False
    # node-limited (group-limited) routing, DeepSeek-V3 (arXiv:2412.19437, Sec. 3.2.2; HF config n_group,
    # topk_group; TorchTitan MoEArgs num_expert_groups / num_limited_groups): the routed experts form
    # n_expert_groups groups and a token picks its top_k experts inside its best n_limited_groups groups
    n_expert_groups: int = field(default=0, metadata=_COUNT)    # 0: no grouping
    n_limited_groups: int = field(default=0, metadata=_COUNT)
    source: str = ""

    def __post_init__(self) -> None:
        if self.n_kv_heads == 0:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim == 0 and self.n_heads > 0:
            if self.dim % self.n_heads:
                raise SpecError(f"model '{self.name}': dim ({self.dim}) must be divisible by n_heads "
                                f"({self.n_heads}), or give head_dim")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        rope = self.qk_rope_head_dim if self.attention == "mla" else self.head_dim
        if rope % 2:
            raise SpecError(f"model '{self.name}': key '{'qk_rope_head_dim' if self.attention == 'mla' else 'head_dim'}' "
                            f"must be even (rotary embeddings turn pairs of channels), got {rope}")
        for k in ("dim", "n_layers", "n_heads", "vocab_size", "ffn_hidden", "n_kv_heads", "head_dim"):
            if getattr(self, k) < 1:
                raise SpecError(f"model '{self.name}': key '{k}' must be a positive integer")
        _choice(f"model '{self.name}'", "mlp", self.mlp, ("swiglu", "gelu"))
        _choice(f"model '{self.name}'", "norm", self.norm, ("rmsnorm", "layernorm"))
        _choice(f"model '{self.name}'", "attention", self.attention, ("gqa", "mla"))
        _choice(f"model '{self.name}'", "score_func", self.score_func, ("softmax", "sigmoid"))
        if self.rope_scaling == "llama3" and not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise SpecError(f"model '{self.name}': key 'rope_high_freq_factor' ({self.rope_high_freq_factor}) must be "
                            f"> 'rope_low_freq_factor' ({self.rope_low_freq_factor})")
        if self.n_heads % self.n_kv_heads:
            raise SpecError(f"model '{self.name}': n_kv_heads ({self.n_kv_heads}) must divide "
                            f"n_heads ({self.n_heads})")
        if self.attention == "mla" and (self.kv_lora_rank < 1 or self.qk_nope_head_dim < 1
                                        or self.qk_rope_head_dim < 1 or self.v_head_dim < 1):
            raise SpecError(f"model '{self.name}': attention 'mla' needs kv_lora_rank, "
                            "qk_nope_head_dim, qk_rope_head_dim and v_head_dim")
        if self.n_experts:
            if self.top_k < 1 or self.top_k > self.n_experts:
                raise SpecError(f"model '{self.name}': key 'top_k' must be in 1..n_experts "
                                f"({self.n_experts}), got {self.top_k}")
            if self.moe_ffn_hidden < 1:
                raise SpecError(f"model '{self.name}': key 'moe_ffn_hidden' must be set for an MoE model")
            if not 0 <= self.n_dense_layers <= self.n_layers:
                raise SpecError(f"model '{self.name}': key 'n_dense_layers' must be in 0..n_layers")
        if self.n_expert_groups:
            if not self.n_experts or self.n_experts % self.n_expert_groups:
                raise SpecError(f"model '{self.name}': key 'n_expert_groups' ({self.n_expert_groups}) must divide "
                                f"n_experts ({self.n_experts})")
            per = self.n_experts // self.n_expert_groups
            if not 1 <= self.n_limited_groups <= self.n_expert_groups or self.n_limited_groups * per < self.top_k:
                raise SpecError(f"model '{self.name}': key 'n_limited_groups' must be in 1..n_expert_groups "
                                f"({self.n_expert_groups}) and hold top_k ({self.top_k}) experts, got "
                                f"{self.n_limited_groups}")
        elif self.n_limited_groups:
            raise SpecError(f"model '{self.name}': key 'n_limited_groups' needs 'n_expert_groups'")

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers if self.is_moe else 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- hardware
def this_host_cores() -> int:
    """The cores this process may run on (its CPU affinity, else os.cpu_count()): what titan-run divides
    among a host's CPU processes as threads, and what a CPU host's `host_cores` is when planned here."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """One accelerator type and the nodes it sits in.

    Bandwidths are per device, one direction, in GB/s (1e9 B/s); latencies in
    microseconds; peak FLOP/s dense (no sparsity).  ``efficiency`` holds the
    achieved fraction of each peak (GEMM, attention, memory-bound ops, and
    collectives per link level) that the cost model applies.
    """

    name: str
    device: Literal["cuda", "cpu", "rocm"]
    peak_tflops_bf16: float
    peak_tflops_fp32: float
    peak_tflops_fp8: float = field(default=0.0, metadata=_COUNT)  # 0 -> no float8 GEMMs
    memory_gib: float = 80.0
    memory_bw_gbs: float = 2000.0
    gpus_per_node: int = 8
    intra_node_bw_gbs: float = 300.0
    intra_node_latency_us: float = field(default=5.0, metadata=_COUNT)
    inter_node_bw_gbs: float | None = None   # per GPU; None (not given) = from the NICs below, else 25
    inter_node_latency_us: float = field(default=10.0, metadata=_COUNT)
    # -- the inter-node network as one GPU sees it: the line rate of a NIC (Gb/s) and how many GPUs
    #    share one (DGX H100: 8x 400 Gb/s ConnectX-7, one per GPU; DGX A100: 8x 200 Gb/s HDR; AWS p4d:
    #    4x 100 Gb/s EFA for 8 GPUs).  When given, inter_node_bw_gbs = nic_gbps / 8 / gpus_per_nic
    #    (every GPU of a node sends at once in a data-parallel or pipeline step, so a shared NIC is
    #    split); rail_optimized: GPU i of every node hangs off the same leaf switch (DGX SuperPOD
    #    reference architecture), so cross-rail traffic is relayed over NVLink first (NCCL PXN)
    nic_gbps: float | None = field(default=None, metadata=_POSITIVE_OPEN)
    gpus_per_nic: float | None = field(default=None, metadata=_POSITIVE_OPEN)
    rail_optimized: bool = True
    efficiency: Mapping[str, float] = field(default_factory=dict)
    memory_reserved_gib: float | None = None  # GiB of a device that the
    #   training process can never allocate tensors in (fixed per process); None (not given) =
    #   cuda_context_gib.  Usable memory is memory_gib - memory_reserved_gib.
    # -- GPU-side memory outside the model's tensors (cost_models.memory adds the last two per plan)
    cuda_context_gib: float = 0.0  # CUDA context, kernel images and the
    #   driver's reserve: the nominal memory minus what the process can allocate before training starts
    nccl_buffer_gib: float = 0.0   # NCCL buffers of ONE communicator
    #   (channels x peers x protocol buffers), allocated outside PyTorch's caching allocator
    allocator_fragmentation: float = 0.0  # reserved/allocated - 1 of the
    #   device's caching allocator at the peak (torch.cuda.max_memory_reserved vs max_memory_allocated);
    #   0 where tensors are freed to the system at once (CPU)
    gpu_names: tuple[str, ...] = ()   # device names this preset stands for (nvidia-smi,
    #   torch.cuda.get_device_name): `preset_for_gpu_name` matches them as substrings
    sm_count: int | None = field(default=None, metadata=_POSITIVE)  # streaming multiprocessors (tile/wave
    #                                quantization of GEMMs); None (not given) = ignore
    kernel_launch_us: float = 4.0  # host (CPU) time per kernel the training loop launches, with the
    #                                framework work around it (Python, autograd, dispatcher, driver)
    host_cores: int | None = field(default=None, metadata=_POSITIVE)  # CPU devices only: cores of one
    #   host, shared by its processes. A plan that runs more processes on a host than it has cores gives
    #   each cores/processes of the per-process throughput measured by `titan-plan profile` (one process
    #   per core); None (not given) = ignore
    # -- CPU devices only: a host running fewer processes than cores gives each cores // processes
    #    threads (titan-run's rule, executor/train.py); t threads run a GEMM 1 + (t-1) x thread_gemm_scaling
    #    times as fast as one and stream memory 1 + (t-1) x thread_memory_scaling times as fast (the per-process
    #    figures above are one thread's). `titan-plan profile` measures both with all of a host's cores in one
    #    process; the defaults are typical of one socket (GEMMs scale with cores, copies with memory channels)
    thread_gemm_scaling: float = field(default=0.9, metadata=_POSITIVE_OPEN)
    thread_memory_scaling: float = field(default=0.5, metadata=_POSITIVE_OPEN)
    source: str = ""

    def __post_init__(self) -> None:
        _choice(f"hardware '{self.name}'", "device", self.device, ("cuda", "cpu", "rocm"))
        self._network()
        for k in ("peak_tflops_bf16", "peak_tflops_fp32", "memory_gib", "memory_bw_gbs",
                  "intra_node_bw_gbs", "inter_node_bw_gbs"):
            if not getattr(self, k) > 0:
                raise SpecError(f"hardware '{self.name}': key '{k}' must be > 0")
        if self.gpus_per_node < 1:
            raise SpecError(f"hardware '{self.name}': key 'gpus_per_node' must be >= 1")
        if (self.sm_count or 0) < 0 or self.kernel_launch_us < 0 or (self.host_cores or 0) < 0:
            raise SpecError(f"hardware '{self.name}': keys 'sm_count', 'kernel_launch_us' and 'host_cores' "
                            "must be >= 0")
        bad = sorted(set(self.efficiency) - set(EFFICIENCY_KEYS))
        if bad:
            raise SpecError(f"hardware '{self.name}': unknown efficiency key '{bad[0]}' "
                            f"(allowed: {', '.join(EFFICIENCY_KEYS)})")
        for k in ("thread_gemm_scaling", "thread_memory_scaling"):
            if not 0 < getattr(self, k) <= 1.0:
                raise SpecError(f"hardware '{self.name}': key '{k}' must be in (0, 1], got {getattr(self, k)}")
        for k, v in self.efficiency.items():
            if not 0 < float(v) <= 1.0:
                raise SpecError(f"hardware '{self.name}': efficiency '{k}' must be in (0, 1], got {v}")
        object.__setattr__(self, "efficiency", {**DEFAULT_EFFICIENCY, **dict(self.efficiency)})
        if self.memory_reserved_gib is None:
            object.__setattr__(self, "memory_reserved_gib", self.cuda_context_gib)
        for k in ("memory_reserved_gib", "cuda_context_gib", "nccl_buffer_gib", "allocator_fragmentation"):
            if not getattr(self, k) >= 0:
                raise SpecError(f"hardware '{self.name}': key '{k}' must be >= 0, got {getattr(self, k)}")
        names = (self.gpu_names,) if isinstance(self.gpu_names, str) else tuple(self.gpu_names)
        if not all(isinstance(g, str) and _name_key(g) for g in names):
            raise SpecError(f"hardware '{self.name}': key 'gpu_names' must be a list of non-empty names, "
                            f"got {self.gpu_names!r}")
        object.__setattr__(self, "gpu_names", names)

    def _network(self) -> None:
        """inter_node_bw_gbs from the NICs when they are given (one home for the fact: a file that gives
        both must agree with itself)."""
        if self.gpus_per_nic is not None and self.nic_gbps is None:
            raise SpecError(f"hardware '{self.name}': key 'gpus_per_nic' needs 'nic_gbps' (the NIC's line rate)")
        if self.nic_gbps is None:
            if self.inter_node_bw_gbs is None:
                object.__setattr__(self, "inter_node_bw_gbs", 25.0)
            return
        if self.gpus_per_nic is None:
            object.__setattr__(self, "gpus_per_nic", 1.0)
        per_gpu = self.nic_gbps / 8.0 / self.gpus_per_nic
        given = self.inter_node_bw_gbs
        if given is not None and abs(given - per_gpu) > 1e-6 * per_gpu:
            raise SpecError(f"hardware '{self.name}': key 'inter_node_bw_gbs' ({given:g}) disagrees with "
                            f"'nic_gbps' / 8 / 'gpus_per_nic' ({per_gpu:g} GB/s); give one of them")
        object.__setattr__(self, "inter_node_bw_gbs", per_gpu)

    @property
    def nics_per_node(self) -> float:
        """NICs of one node (gpus_per_node / gpus_per_nic; gpus_per_node when the NICs are not given)."""
        return self.gpus_per_node / (self.gpus_per_nic or 1.0)

    @property
    def supports_float8(self) -> bool:
        return self.peak_tflops_fp8 > 0

    def _procs_per_host(self, world_size) -> np.ndarray | None:
        """Processes on one CPU host, min(world, gpus_per_node) (`world_size` may be an array); None for
        accelerators and when `host_cores` is not given."""
        if self.device != "cpu" or not self.host_cores or self.host_cores <= 0:
            return None
        return np.minimum(np.asarray(world_size, dtype=np.float64), self.gpus_per_node)

    def oversubscription(self, world_size) -> np.ndarray:
        """Slowdown of CPU work per process: processes on one host / its cores (>= 1); 1.0 for accelerators
        and when `host_cores` is not given."""
        p = self._procs_per_host(world_size)
        return np.ones_like(np.asarray(world_size, dtype=np.float64)) if p is None \
            else np.maximum(1.0, p / self.host_cores)

    def threads_per_process(self, world_size) -> np.ndarray:
        """Threads of one process: cores // processes of its host (>= 1), as titan-run sets them; 1 for
        accelerators and when `host_cores` is not given."""
        p = self._procs_per_host(world_size)
        return np.ones_like(np.asarray(world_size, dtype=np.float64)) if p is None \
            else np.maximum(1.0, np.floor(self.host_cores / p))

    def thread_speedups(self, threads: float) -> tuple[float, float]:
        """(GEMM, memory bandwidth) of one process on `threads` threads over one thread: 1 + (t-1) x the
        thread scaling of each."""
        t = max(1.0, float(threads))
        return 1.0 + (t - 1.0) * self.thread_gemm_scaling, 1.0 + (t - 1.0) * self.thread_memory_scaling

    def for_world(self, world_size: int) -> "HardwareSpec":
        """This spec as one process of a `world_size` job sees it: on a CPU host with more cores than
        processes, the GEMM peaks and the memory bandwidth of `threads_per_process` threads (the thread
        scalings above), and host_cores = the processes (so the result is a one-core-per-device spec and
        applying this again changes nothing).  Unchanged elsewhere."""
        t = float(self.threads_per_process(world_size))
        if t <= 1.0:
            return self
        g, m = self.thread_speedups(t)
        return dataclasses.replace(
            self, peak_tflops_bf16=self.peak_tflops_bf16 * g, peak_tflops_fp32=self.peak_tflops_fp32 * g,
            peak_tflops_fp8=self.peak_tflops_fp8 * g, memory_bw_gbs=self.memory_bw_gbs * m,
            host_cores=int(min(world_size, self.gpus_per_node)))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["efficiency"] = dict(self.efficiency)
        d["gpu_names"] = list(self.gpu_names)
        return d


EFFICIENCY_KEYS = ("gemm", "attention", "fp8_gemm", "memory_bound", "comm_intra", "comm_inter")
DEFAULT_EFFICIENCY = {"gemm": 0.7, "attention": 0.5, "fp8_gemm": 0.55, "memory_bound": 0.7,
                      "comm_intra": 0.8, "comm_inter": 0.8}


# --------------------------------------------------------------------------- loaders
def preset_names(kind: str) -> list[str]:
    return sorted(p.stem for p in (PRESET_DIR / kind).glob("*.yaml"))


def load_model(name_or_path: str | os.PathLike) -> ModelSpec:
    if hf_config.is_hf_ref(name_or_path):     # hf:DIR, a Hugging Face model folder's config.json
        try:
            return _build(ModelSpec, hf_config.model_dict(str(name_or_path)[len(hf_config.PREFIX):]), str(name_or_path))
        except hf_config.HFConfigError as e:
            raise SpecError(str(e)) from None
    return _load("models", name_or_path, ModelSpec)


def load_hardware(name_or_path: str | os.PathLike) -> HardwareSpec:
    return _load("hardware", name_or_path, HardwareSpec)


def preset_for_gpu_name(name: str, memory_gib: float | None = None) -> str | None:
    """The hardware preset of a GPU from its device name (``nvidia-smi --query-gpu=name``,
    ``torch.cuda.get_device_name``), or None when no preset lists it.

    Each preset's ``gpu_names`` are matched as substrings of `name`, ignoring case, spaces and
    dashes ("NVIDIA A100-SXM4-40GB" matches "A100 SXM4 40GB").  The longest matching entry wins;
    between presets that match equally well the one whose ``memory_gib`` is closest to
    `memory_gib` (the device's total memory, when given), then the first by preset name.
    """
    best: tuple | None = None
    for preset, hit in gpu_name_hits(name).items():
        hw = load_hardware(preset)
        gap = abs(hw.memory_gib - memory_gib) if memory_gib is not None else 0.0
        rank = (-hit, gap, preset)
        if best is None or rank < best:
            best = rank
    return None if best is None else best[2]


def gpu_name_hits(name: str) -> dict[str, int]:
    """{hardware preset: the length of its longest ``gpu_names`` entry found in `name`}, for the presets one is
    found in: an entry's words in a row, ignoring case, spaces and dashes ('H100' in 'NVIDIA H100 80GB HBM3' and
    'A100 SXM4 40GB' in 'NVIDIA A100-SXM4-40GB', not 'H100' in 'h1000' nor 'H200' in 'GH200')."""
    words = _words(name)
    hits = {}
    for preset in preset_names("hardware"):
        found = [len("".join(w)) for w in map(_words, load_hardware(preset).gpu_names)
                 if any(words[i:i + len(w)] == w for i in range(len(words)))]
        if found:
            hits[preset] = max(found)
    return hits


def _name_key(name: str) -> str:
    """A device name reduced to lower-case letters and digits (the form `preset_for_gpu_name` compares)."""
    return "".join(c for c in str(name).lower() if c.isalnum())


def model_from_dict(d: Mapping[str, Any], where: str = "model") -> ModelSpec:
    return _build(ModelSpec, d, where)


def hardware_from_dict(d: Mapping[str, Any], where: str = "hardware") -> HardwareSpec:
    return _build(HardwareSpec, d, where)


def _load(kind: str, name_or_path: str | os.PathLike, cls):
    s = str(name_or_path)
    what = "model" if kind == "models" else kind
    if not s.strip():
        raise SpecError(f"{what}: an empty name; give a preset name ({', '.join(preset_names(kind))}) "
                        "or the path of a YAML file")
    path = Path(s)
    published = _published_model(s) if kind == "models" and not _is_file(path) else None
    if published:
        path = PRESET_DIR / kind / f"{published}.yaml"
    elif kind == "models" and s.count("/") == 1 and not s.endswith((".yaml", ".yml")) and not path.exists():
        raise SpecError(f"unknown model {show(s)}: not a file, and no preset is published under that name (known: "
                        f"{', '.join(preset_names(kind))}); for a Hugging Face model, give hf:DIR, a folder with its "
                        f"config.json")
    elif not (s.endswith((".yaml", ".yml")) or os.sep in s or _is_file(path)):
        path = PRESET_DIR / kind / f"{_preset_spelled(kind, s.strip())}.yaml"
        if not _is_file(path):
            known = preset_names(kind)
            hint = did_you_mean(s, known, prefixes=True)
            raise SpecError(f"unknown {what} {show(s)}{hint}; "
                            f"known: {', '.join(known)}; or give the path of a YAML file")
    data = read_yaml(path, error=SpecError, what=f"{kind} file")
    if not isinstance(data, Mapping):
        raise SpecError(f"{path}: expected a mapping of keys, got {type(data).__name__}")
    data = dict(data)
    data.setdefault("name", path.stem)
    return _build(cls, data, str(path))


# The names the model presets are published under (Hugging Face hub ids, as their papers name them), which --model
# reads as the preset: the same architecture (Llama 3, 3.1 and 3.3 of one size share their dimensions; the preset is
# 3.1's, with its 128K context).  A checkpoint at hand is read with hf:DIR instead (its config.json).
PUBLISHED_MODEL_NAMES = {
    "llama3-8b": ("meta-llama/Meta-Llama-3-8B", "meta-llama/Llama-3.1-8B", "Llama 3.1 8B"),
    "llama3-70b": ("meta-llama/Meta-Llama-3-70B", "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.3-70B",
                   "Llama 3.1 70B"),
    "llama3-405b": ("meta-llama/Llama-3.1-405B", "meta-llama/Meta-Llama-3.1-405B", "Llama 3.1 405B"),
    "deepseek-v3-671b": ("deepseek-ai/DeepSeek-V3", "DeepSeek-V3 671B"),
    "deepseek-v2-236b": ("deepseek-ai/DeepSeek-V2", "DeepSeek-V2 236B"),
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x7B-Instruct-v0.1", "Mixtral 8x7B"),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B",),
    "qwen3-235b-a22b": ("Qwen/Qwen3-235B-A22B", "Qwen3 235B-A22B"),
    "mixtral-8x22b": ("mistralai/Mixtral-8x22B-v0.1", "mistralai/Mixtral-8x22B-Instruct-v0.1", "Mixtral 8x22B"),
    "llama2-70b": ("meta-llama/Llama-2-70b-hf", "meta-llama/Llama-2-70b-chat-hf", "Llama 2 70B"),
    "bloom-176b": ("bigscience/bloom", "BLOOM 176B", "BLOOM"),
    "gpt3-175b": ("GPT-3 175B", "GPT-3"),
    "nemotron4-340b": ("nvidia/Nemotron-4-340B-Base", "nvidia/Nemotron-4-340B-Instruct", "Nemotron-4 340B"),
}
_RELEASE_SUFFIXES = ("instruct", "base", "chat", "hf")


def _model_key(name: str) -> str:
    """A published model name reduced for matching: the part after the hub organisation, letters and digits in lower
    case, without a release suffix ('meta-llama/Llama-3.1-70B-Instruct' -> 'llama3170b')."""
    key = _name_key(str(name).rsplit("/", 1)[-1])
    for suffix in _RELEASE_SUFFIXES:
        key = key[: -len(suffix)] if key.endswith(suffix) and len(key) > len(suffix) else key
    return key


def _published_model(name: str) -> str | None:
    """The model preset published as `name` (PUBLISHED_MODEL_NAMES), or None."""
    key = _model_key(name)
    hits = [p for p, names in PUBLISHED_MODEL_NAMES.items() if key in map(_model_key, names)]
    return hits[0] if len(hits) == 1 else None


def _preset_spelled(kind: str, name: str) -> str:
    """The preset a hand-written name means: the name itself; else the one preset it spells but for case and
    separators ('H800', 'Llama3_8B'); for hardware, else the one preset it begins ('h100-96g'), else the one
    preset whose GPU device names it matches best ('H100' and 'NVIDIA H100 80GB HBM3' are h100-sxm,
    'A100-SXM4-80GB' a100-80g; a bare 'A100' names two presets and stays unknown).  Unmatched: the name unchanged."""
    known = preset_names(kind)
    if name in known:
        return name
    same = [k for k in known if _name_key(k) == _name_key(name)]
    if len(same) == 1:
        return same[0]
    if kind != "hardware" or not _name_key(name):
        return name
    begun = [k for k in known if _name_key(k).startswith(_name_key(name))]
    if len(begun) == 1 and len(_name_key(name)) >= 4:
        return begun[0]
    hits = gpu_name_hits(name)                  # a GPU device name: the one preset it matches best
    best = [p for p, n in hits.items() if n == max(hits.values(), default=0)]
    return best[0] if len(best) == 1 else name


def _words(name: str) -> list[str]:
    """A name's words, lower-case: 'A100-SXM4-80GB' is ['a100', 'sxm4', '80gb']."""
    return "".join(c if c.isalnum() else " " for c in str(name).lower()).split()


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:          # e.g. a name too long: not a file, so it is read as a preset name
        return False


def _build(cls, d: Mapping[str, Any], where: str):
    """The one typed reader (search_spaces.typed): keys, types, Literal choices and ranges of `cls`."""
    return from_mapping(cls, d, where=where, error=SpecError)


def _choice(where: str, key: str, value: Any, allowed: tuple[str, ...]) -> None:
    """For specs built in code (the files are checked by `_build` from the Literal annotations)."""
    if value not in allowed:
        raise SpecError(f"{where}: key '{key}' must be one of {', '.join(allowed)}; got {value!r}")

"""`Plan`: one point of the search space (mesh degrees plus knobs).

The mesh is ``world = dp_replicate * dp_shard * pp * tp * cp``.  Expert
parallelism does not add a mesh axis of its own: as in TorchTitan and
Megatron-LM, the ``ep`` ranks are carved out of the ``dp_shard * cp`` ranks
(the ranks that hold different tokens), so ``ep`` must divide
``dp_shard * cp``.  Expert weights are sharded ``ep`` ways and FSDP-sharded
over the remaining ``dp_shard * cp / ep`` ranks; dense weights are
FSDP-sharded over all ``dp_shard * cp`` ranks.

``microbatch`` is the number of sequences one rank processes in one forward
pass; ``n_microbatches`` is how many such micro-batches each data-parallel
rank runs per optimizer step (pipeline micro-batches when ``pp > 1``,
gradient-accumulation steps otherwise), so that
``global_batch = dp_replicate * dp_shard * microbatch * n_microbatches``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # exactly 2 stages per rank, V placement
AC_MODES = ("none", "selective", "full")
BACKENDS = ("spmd_types", "dtensor")

DEGREE_KEYS = ("dp_replicate", "dp_shard", "pp", "tp", "cp", "ep")


class PlanError(ValueError):
    """A plan (or a plan file) that is malformed or does not fit its world."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    dp_replicate: int = 1
    dp_shard: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    microbatch: int = 1
    n_microbatches: int = 1
    schedule: str = "1F1B"
    stages_per_rank: int = 1
    ac: str = "none"
    reshard_after_forward: bool = True
    compile: bool = False
    float8: bool = False
    backend: str = "spmd_types"

    def __post_init__(self) -> None:
        self.validate()

    # -- derived -----------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.pp * self.tp * self.cp

    @property
    def dp(self) -> int:
        """Ranks holding different sequences (the batch is split this many ways)."""
        return self.dp_replicate * self.dp_shard

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.dp * self.microbatch * self.n_microbatches

    # -- validation ----------------------------------------------------------
    def validate(self) -> None:
        for key in DEGREE_KEYS + ("microbatch", "n_microbatches", "stages_per_rank"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"plan key '{key}' must be a positive integer, got {v!r}")
        for key in ("reshard_after_forward", "compile", "float8"):
            v = getattr(self, key)
            if not isinstance(v, bool):
                raise PlanError(f"plan key '{key}' must be true or false, got {v!r}")
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("ac", self.ac, AC_MODES)
        _check_choice("backend", self.backend, BACKENDS)
        if (self.dp_shard * self.cp) % self.ep:
            raise PlanError(
                f"plan key 'ep' ({self.ep}) must divide dp_shard*cp ({self.dp_shard}*{self.cp}"
                f"={self.dp_shard * self.cp}): expert parallelism is carved out of dp_shard x cp")
        if self.schedule in V_SCHEDULES and self.stages_per_rank != 2:
            raise PlanError(f"plan key 'stages_per_rank' must be 2 for schedule {self.schedule}, "
                            f"got {self.stages_per_rank}")
        if self.schedule == "Interleaved1F1B" and self.stages_per_rank < 2:
            raise PlanError("plan key 'stages_per_rank' must be >= 2 for schedule Interleaved1F1B, "
                            f"got {self.stages_per_rank}")
        if self.schedule in ("GPipe", "1F1B") and self.stages_per_rank != 1:
            raise PlanError(f"plan key 'stages_per_rank' must be 1 for schedule {self.schedule}, "
                            f"got {self.stages_per_rank}")
        if self.pp > 1 and self.n_microbatches < min_microbatches(self.schedule, self.pp):
            raise PlanError(
                f"plan key 'n_microbatches' ({self.n_microbatches}) is too small for schedule "
                f"{self.schedule} with pp={self.pp}: needs at least "
                f"{min_microbatches(self.schedule, self.pp)}")
        if self.pp > 1 and self.schedule == "Interleaved1F1B" and not interleaved_rounds_ok(self.n_microbatches,
                                                                                           self.pp):
            raise PlanError(
                f"plan key 'n_microbatches' ({self.n_microbatches}) must be a multiple of "
                f"max(1, n_microbatches // pp) = {max(1, self.n_microbatches // self.pp)} for Interleaved1F1B")

    def check_world(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise PlanError(
                f"plan degrees dp_replicate*dp_shard*pp*tp*cp = {self.dp_replicate}*{self.dp_shard}*"
                f"{self.pp}*{self.tp}*{self.cp} = {self.world_size}, but the world size is {world_size}")

    # -- wire format ---------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "plan") -> "Plan":
        if not isinstance(d, Mapping):
            raise PlanError(f"{where} must be a mapping of plan keys, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PlanError(f"{where}: unknown key '{unknown[0]}' (allowed: {', '.join(sorted(known))})")
        return cls(**dict(d))

    def describe(self) -> str:
        parts = [f"{k}{getattr(self, k)}" for k in ("dp_replicate", "dp_shard", "pp", "tp", "cp", "ep")
                 if getattr(self, k) > 1]
        s = "x".join(parts) if parts else "single"
        if self.pp > 1:
            s += f" {self.schedule}(v={self.stages_per_rank})"
        return f"{s} mb{self.microbatch}x{self.n_microbatches} ac={self.ac}"


def min_microbatches(schedule: str, pp: int) -> int:
    """Fewest micro-batches a schedule accepts with `pp` pipeline ranks.

    torch.distributed.pipelining (2.11, 2.14): 1F1B needs >= pp; DualPipeV
    needs >= its 2*pp stages; GPipe, Interleaved1F1B and ZBVZeroBubble would
    run fewer but leave stages idle, so we require >= pp for them too.
    """
    if pp <= 1:
        return 1
    return 2 * pp if schedule == "DualPipeV" else pp


def interleaved_rounds_ok(n_microbatches: int, pp: int) -> bool:
    """torch's Interleaved1F1B runs the micro-batches in rounds of max(1, n // pp): n must divide evenly."""
    return n_microbatches % max(1, n_microbatches // pp) == 0


def _check_choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise PlanError(f"plan key '{key}' must be one of {', '.join(allowed)}; got {value!r}")

"""`CandidateTable`: many plans as columns of numpy arrays.

The cost models score every candidate at once, so the enumerator produces a
table (one array per `Plan` field) instead of a list of objects.  String
knobs are stored as small integer codes into the tuples of `plan.py`.  The
derived facts of `plan.PlanFacts` (``fsdp_size``, ``dp_cp``, ``seq_divisor``,
``expert_fsdp_size``, ``n_stages``, ``is_v_schedule``, ...) are columns too,
computed by the same code as for one `Plan`.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

import numpy as np

from .plan import AC_MODES, BACKENDS, SCHEDULES, Plan, PlanFacts

INT_COLUMNS = ("dp_replicate", "dp_shard", "pp", "tp", "cp", "ep", "microbatch", "n_microbatches",
               "stages_per_rank")
BOOL_COLUMNS = ("reshard_after_forward", "compile", "float8")
CODE_COLUMNS = {"schedule": SCHEDULES, "ac": AC_MODES, "backend": BACKENDS}
COLUMNS = INT_COLUMNS + BOOL_COLUMNS + tuple(CODE_COLUMNS)

assert set(COLUMNS) == {f.name for f in dataclasses.fields(Plan)}


class Columns(PlanFacts):
    """Some or all plan fields as equal-length arrays, with the derived facts of `PlanFacts`.

    The enumerator checks the layout rules on these while it builds candidates stage by stage.
    """

    __slots__ = ("_cols", "memo")

    def __init__(self, columns: Mapping[str, np.ndarray]):
        self._cols = dict(columns)
        # what the cost models derive from the columns alone (`cost_models.layout`'s groupings, representative
        # sub-tables and per-layout results): the columns are never written after construction
        self.memo: dict = {}

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self._cols[name]
        except KeyError:
            raise AttributeError(name) from None

    def __len__(self) -> int:
        return len(next(iter(self._cols.values())))

    @property
    def columns(self) -> dict[str, np.ndarray]:
        return dict(self._cols)

    def is_schedule(self, name: str) -> np.ndarray:
        return self._cols["schedule"] == SCHEDULES.index(name)

    def is_ac(self, name: str) -> np.ndarray:
        return self._cols["ac"] == AC_MODES.index(name)


class CandidateTable(Columns):
    """Columns of equal length; `t.tp` is an int64 array, `t.ac` an int8 code array."""

    __slots__ = ()

    def __init__(self, columns: Mapping[str, np.ndarray]):
        missing = set(COLUMNS) - set(columns)
        assert not missing, f"missing columns {missing}"
        n = len(next(iter(columns.values())))
        cols = {}
        for k in COLUMNS:
            a = np.asarray(columns[k])
            assert a.shape == (n,), (k, a.shape, n)
            if k in INT_COLUMNS:
                a = a.astype(np.int64, copy=False)
            elif k in BOOL_COLUMNS:
                a = a.astype(bool, copy=False)
            else:
                a = a.astype(np.int8, copy=False)
            cols[k] = a
        super().__init__(cols)

    def __len__(self) -> int:
        return len(self._cols["tp"])

    def take(self, idx) -> "CandidateTable":
        return CandidateTable({k: v[idx] for k, v in self._cols.items()})

    def plan(self, i: int) -> Plan:
        kw = {}
        for k in INT_COLUMNS:
            kw[k] = int(self._cols[k][i])
        for k in BOOL_COLUMNS:
            kw[k] = bool(self._cols[k][i])
        for k, names in CODE_COLUMNS.items():
            kw[k] = names[int(self._cols[k][i])]
        return Plan(**kw)

    def plans(self) -> list[Plan]:
        return [self.plan(i) for i in range(len(self))]

    @classmethod
    def from_plans(cls, plans: Iterable[Plan]) -> "CandidateTable":
        plans = list(plans)
        cols: dict[str, list] = {k: [] for k in COLUMNS}
        for p in plans:
            for k in INT_COLUMNS + BOOL_COLUMNS:
                cols[k].append(getattr(p, k))
            for k, names in CODE_COLUMNS.items():
                cols[k].append(names.index(getattr(p, k)))
        dtypes = {**{k: np.int64 for k in INT_COLUMNS}, **{k: bool for k in BOOL_COLUMNS},
                  **{k: np.int8 for k in CODE_COLUMNS}}
        return cls({k: np.array(v, dtype=dtypes[k]) for k, v in cols.items()})

    @classmethod
    def concat(cls, tables: list["CandidateTable"]) -> "CandidateTable":
        return cls({k: np.concatenate([t._cols[k] for t in tables]) for k in COLUMNS})

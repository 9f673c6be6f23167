"""Search spaces: `Plan` (one point), the legality rules, and the vectorized enumerator."""
from .constraints import Target, check_plan
from .enumerate import Enumeration, enumerate_plans
from .plan import AC_MODES, BACKENDS, SCHEDULES, Plan, PlanError
from .space import SearchSpace, SpaceError, load_space, space_names
from .table import CandidateTable

__all__ = ["AC_MODES", "BACKENDS", "SCHEDULES", "CandidateTable", "Enumeration", "Plan", "PlanError",
           "SearchSpace", "SpaceError", "Target", "check_plan", "enumerate_plans", "load_space", "space_names"]

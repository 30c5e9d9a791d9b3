"""Planning: rk-Checkmate block options, rk-Rotor over the chain, one simulator, baselines.

Functions of plain data (CD-graphs, chains, budgets) returning schedules; no torch here.
"""

from solvers.block_options import GridReport, pareto_front, solve_class_options
from solvers.bounds import OperationFloor, operation_floor
from solvers.checkmate_ilp import ILPSolution, RkCheckmateILP, highs_available
from solvers.options import (
    BlockOption,
    ClassOptions,
    NoGradForward,
    autograd_option,
    no_grad_forward,
    option_from_computes,
    with_outputs_kept,
)
from solvers.registry import (
    SOLVERS,
    ChainPlanner,
    CheckmateSolver,
    NoRecomputeSolver,
    RockmateSolver,
    RotorSolver,
    get_solver,
    min_budget,
    no_recompute_schedule,
    solve,
)
from solvers.rotor_dp import BlockCosts, ChainAction, ChainCosts, ChainStrategy, OptionCosts, solve_chain, strategy_peak
from solvers.schedule import Compute, Forget, Operation, Plan, Schedule
from solvers.simulate import InvalidSchedule, SimulationResult, schedule_from_computes, simulate

__all__ = [
    "BlockCosts", "BlockOption", "ChainAction", "ChainCosts", "ChainPlanner", "ChainStrategy",
    "CheckmateSolver", "ClassOptions", "Compute", "Forget", "GridReport", "ILPSolution",
    "InvalidSchedule", "NoGradForward", "NoRecomputeSolver", "Operation", "OperationFloor", "OptionCosts", "Plan",
    "RkCheckmateILP", "RockmateSolver", "RotorSolver", "SOLVERS", "Schedule", "SimulationResult",
    "autograd_option", "get_solver", "highs_available", "min_budget", "no_grad_forward",
    "no_recompute_schedule", "operation_floor", "option_from_computes", "pareto_front", "schedule_from_computes",
    "simulate", "solve", "solve_chain", "solve_class_options", "strategy_peak", "with_outputs_kept",
]

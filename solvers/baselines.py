"""The baselines under the same machinery: Rotor, whole-graph Checkmate, no recomputation.

They share the option types, the DP, the ILP and the simulator with Rockmate, so they differ
only in what they search (Zhao et al., Rockmate, ICML 2023, section 5):

- :class:`RotorSolver`: the rk-Rotor DP where each block has one option, autograd (keep
  everything), besides the forward without grad (keep nothing): Rotor's two cases (Beaumont
  et al., 2019);
- :class:`CheckmateSolver`: rk-Checkmate on the whole model's CD-graph (Jain et al., 2020),
  the optimal reference on small models;
- :class:`NoRecomputeSolver`: autograd, no recomputation; its time is every plan's
  ``baseline_time``.
"""

from solvers.registry import CheckmateSolver, NoRecomputeSolver, RotorSolver, no_recompute_schedule

__all__ = ["RotorSolver", "CheckmateSolver", "NoRecomputeSolver", "no_recompute_schedule"]

"""Mixture of Experts (DeepSpeed-MoE), PyTorch-native.

Parts, one job each:

* :mod:`.layer` - ``MoE``, the layer users put in their model: gate + experts (+ PR-MoE's
  residual MLP with its learned mixing coefficient); returns ``(output, l_aux, exp_counts)``.
* :mod:`.sharded_moe` - the gates (``TopKGate``: top-1, top-2, general top-k, capacity,
  token dropping, random token selection, noisy gates, load-balancing loss) and
  ``MOELayer``, which dispatches the tokens each gate kept to the ranks that hold their
  experts and combines the results (``torch.distributed`` all-to-all with exact, uneven
  splits: no padding travels).
* :mod:`.experts` - ``Experts``: the local experts, their parameters marked
  ``allreduce=False`` / ``group_name`` so training reduces them over the
  expert-data-parallel group.
* :mod:`.utils` - ``is_moe_param``, ``split_params_into_different_moe_groups_for_optimizer``, ...
* :mod:`.checkpoint` - expert weights in DeepSpeed's per-expert files and back, at any ep size
  (registered with the generic checkpoint code as a module part when this package is imported).
* :mod:`.training` - what the engine needs: the composite strategy that reduces expert
  gradients over their own groups and steps with one global norm / overflow decision, and
  the start-up broadcast of expert weights over their expert-data-parallel groups.

Process groups live in :mod:`deepspeed.utils.groups`.
"""
from .layer import MoE  # noqa: F401
from . import checkpoint  # noqa: F401,E402  (registers MoE's per-expert checkpoint files)

"""What a step does when the global gradient norm is not finite (NaN or Inf) without fp16
loss scaling / bf16 overflow checking (which skip such steps already).

Why: at fp32 (and bf16 without ``check_grad_overflow``) one NaN loss used to turn every
weight into NaN, with nothing said. Now the step is skipped - the weights and optimizer
state are left as they were, the gradients dropped - a warning names the step, and
``engine.skipped_steps`` counts it (the LR schedule does not advance, as for an fp16
overflow). Config key ``"nonfinite_gradients"``: ``"skip"`` (default) or ``"raise"``
(:class:`NonFiniteGradientError` instead, to stop a run at its first bad step). Every rank
sees the same global norm, so every rank decides the same way.
"""
from __future__ import annotations

from ..utils.logging import logger

SKIP, RAISE = "skip", "raise"


class NonFiniteGradientError(FloatingPointError):
    """The global gradient norm was NaN/Inf and the config asks to stop (``"nonfinite_gradients": "raise"``)."""


def policy(config) -> str:
    return getattr(getattr(config, "model", config), "nonfinite_gradients", SKIP) or SKIP


def on_nonfinite(config, norm: float, where: str) -> None:
    """Report a non-finite global gradient norm: raise under the ``"raise"`` policy, else warn
    (the caller then skips the step and returns ``StepOutcome(skipped=True)``)."""
    from ..comm.timeouts import step_text
    at = step_text() or " at this step"
    if policy(config) == RAISE:
        raise NonFiniteGradientError(
            f"{where}: the global gradient norm is {norm}{at} (a NaN/Inf loss or gradient); stopping as the config "
            f"asks (\"nonfinite_gradients\": \"raise\"). The weights are unchanged by this step.")
    logger.warning(f"{where}: the global gradient norm is {norm}{at}: optimizer step skipped (weights and optimizer "
                   f"state unchanged; counted in engine.skipped_steps). Set \"nonfinite_gradients\": \"raise\" to "
                   f"stop instead.")

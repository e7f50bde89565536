"""``compression_scheduler``: switches each technique on at its ``schedule_offset`` and
moves the weight-quantization bits along their schedule, driven by a step count.

``step()`` counts one optimizer step (DeepSpeed's engine calls it after every applied
step); ``set_step(n)`` jumps to ``n`` steps (what the engine's compression hook does with
its own applied-step count, so a resumed run lands on the same state). Each technique's
state is a pure function of the step count:

* weight quantization, from ``schedule_offset``: the flag is on and the bits are
  ``start_bits`` minus one for every period passed (periods doubling, see
  :func:`~.utils.scheduled_bits`); with ``quantize_weight_in_forward: false`` the weights
  are quantized in place once per step (DeepSpeed's MoQ: the quantization lives in the
  optimizer step), mixed with the unquantized values when ``fp16_mixed_quantize`` is on;
* activation quantization, sparse / row / head / channel pruning: on from their
  ``schedule_offset``; ``snip_momentum`` masks move on their own schedule (:mod:`.snip`).
"""
from __future__ import annotations

from ..utils.logging import logger
from .config import parse_compression_section
from .constants import (ACTIVATION_QUANTIZATION, CHANNEL_PRUNING, HEAD_PRUNING, ROW_PRUNING, SPARSE_PRUNING,
                        WEIGHT_QUANTIZATION)
from .helper import TECHNIQUE_TYPES, get_module_name, recursive_getattr
from .snip import find_pruner

_FLAGS = {
    WEIGHT_QUANTIZATION: "weight_quantization_enabled",
    ACTIVATION_QUANTIZATION: "activation_quantization_enabled",
    SPARSE_PRUNING: "sparse_pruning_enabled",
    ROW_PRUNING: "row_pruning_enabled",
    HEAD_PRUNING: "head_pruning_enabled",
    CHANNEL_PRUNING: "channel_pruning_enabled",
}


def bits_and_phase(start_bits: int, target_bits: int, period: int, steps: int):
    """(bits after ``steps`` quantized steps, steps since the bits last changed)."""
    bits, p, last = start_bits, period, 0
    while bits > target_bits and steps >= p:
        bits -= 1
        last = p
        p *= 2
    return bits, steps - last


class compression_scheduler:
    """Schedules the compression techniques of a model prepared by ``init_compression``.

    ``compression_config``: the ``compression_training`` section (dict, as
    ``get_compression_config`` returns it or as written in the DeepSpeed config, or the
    typed section), or a whole DeepSpeed config.
    """

    def __init__(self, model, compression_config):
        self.model = model
        cfg = compression_config
        if isinstance(cfg, dict) and "compression_training" not in cfg:
            cfg = {"compression_training": cfg}
        self.section = parse_compression_section(cfg)
        self.training_steps = 0
        self.weight_quantization_enabled = False
        self.verbose = {t: False for t in _FLAGS}
        self._quantized_at = None  # the step whose weights were quantized in place (once per step)
        self.make_init()

    def make_init(self):
        """Resolve each enabled technique's modules once (they were swapped in by ``init_compression``)."""
        self.different_compression_methods = {}
        for technique in _FLAGS:
            tech = getattr(self.section, technique)
            if tech is None or not tech.shared_parameters.enabled:
                continue
            modules = []
            seen = set()
            for group_name, group in tech.different_groups.items():
                for key_word in group.modules:
                    names, seen = get_module_name(group_name, self.model, key_word, seen, verbose=False,
                                                  types=TECHNIQUE_TYPES[technique])
                    for n in names:
                        m = recursive_getattr(self.model, n)
                        if hasattr(m, _FLAGS[technique]):
                            modules.append((n, m, group.params))
            self.different_compression_methods[technique] = {"shared_parameters": tech.shared_parameters,
                                                              "modules": modules}

    # ---------------------------------------------------------------- stepping
    def step(self, step_zero_check=False):
        """One more optimizer step (``step_zero_check=True``: apply the state of the current
        step without counting, as the engine does before the first forward)."""
        if not step_zero_check:
            self.training_steps += 1
        self.check_all_modules()

    def set_step(self, steps: int) -> None:
        """Jump to ``steps`` completed optimizer steps and apply that state."""
        self.training_steps = int(steps)
        self.check_all_modules()

    def state_dict(self) -> dict:
        return {"training_steps": self.training_steps}

    def load_state_dict(self, state: dict) -> None:
        self.set_step(state["training_steps"])

    def _on(self, technique):
        entry = self.different_compression_methods.get(technique)
        if entry is None:
            return None, False
        return entry, self.training_steps >= entry["shared_parameters"].schedule_offset

    def _set_flags(self, technique, entry, on):
        for _, m, _ in entry["modules"]:
            setattr(m, _FLAGS[technique], on)
        if on and not self.verbose[technique]:
            logger.info(f"{technique} is enabled at step {self.training_steps}")
            self.verbose[technique] = True

    def check_weight_quantization(self):
        entry, on = self._on(WEIGHT_QUANTIZATION)
        if entry is None:
            return
        self._set_flags(WEIGHT_QUANTIZATION, entry, on)
        self.weight_quantization_enabled = on
        if not on:
            return
        shared = entry["shared_parameters"]
        steps = self.training_steps - shared.schedule_offset
        in_place = self._quantized_at != self.training_steps
        self._quantized_at = self.training_steps
        for name, m, params in entry["modules"]:
            bits, phase = bits_and_phase(params.start_bits, params.target_bits, params.quantization_period, steps)
            if shared.quantize_verbose and bits != m.weight_quantize_bits:
                logger.info(f"weight_quantization: {name} now at {bits} bits (step {self.training_steps})")
            m.weight_quantize_bits = bits
            if in_place and not m.weight_quantization_enabled_in_forward:
                mix = 0.0
                if shared.fp16_mixed_quantize.enabled:
                    mix = max(0.0, 1.0 - shared.fp16_mixed_quantize.quantize_change_ratio * (phase + 1))
                m.quantize_weight_(mix)

    def _check_simple(self, technique):
        entry, on = self._on(technique)
        if entry is not None:
            self._set_flags(technique, entry, on)

    def check_activation_quantization(self):
        self._check_simple(ACTIVATION_QUANTIZATION)

    def check_sparse_pruning(self):
        self._check_simple(SPARSE_PRUNING)
        pruner = find_pruner(self.model)
        if pruner is not None:
            for m in pruner.modules:
                m.sparse_pruning_enabled = self.training_steps >= pruner.start
            pruner.update(self.training_steps)

    def check_head_pruning(self):
        self._check_simple(HEAD_PRUNING)

    def check_row_pruning(self):
        self._check_simple(ROW_PRUNING)

    def check_channel_pruning(self):
        self._check_simple(CHANNEL_PRUNING)

    def check_all_modules(self):
        self.check_weight_quantization()
        self.check_activation_quantization()
        self.check_sparse_pruning()
        self.check_head_pruning()
        self.check_row_pruning()
        self.check_channel_pruning()

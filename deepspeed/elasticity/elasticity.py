"""Elastic batch sizes: one global batch size that many GPU counts can train with.

Gradient accumulation lets a global batch be split as
``micro_batch * gradient_accumulation_steps * world_size`` in many ways. Elastic
training picks a global batch size (at most ``max_train_batch_size``) whose set of
*valid* GPU counts is as large as possible, so a scheduler may grow or shrink the job
across that set without changing the optimisation (same global batch).

The algorithm (DeepSpeed's, versions 0.1 and 0.2):

v0.1
  1. Bases: every micro batch size and their least common multiple.
  2. Each base ``b`` (not above the maximum ``M``) is scaled by the largest highly
     composite number ``h <= M // b`` (highly composite numbers have more divisors than
     any smaller number, so ``b * h`` divides many ways): candidate ``b * h``.
  3. A GPU count ``g`` is valid for a candidate ``B`` when some micro batch ``m`` has
     ``g * m`` dividing ``B`` and ``min_gpus <= g <= max_gpus``.
  4. The candidate with most valid GPU counts wins; ties go to the larger batch
     (``prefer_larger_batch``, default) or the smaller one.
v0.2 (node granularity, model parallelism)
  The v0.1 search runs over *nodes*: maximum batch ``M / dp_per_node``, GPU range
  divided by ``num_gpus_per_node``, where ``dp_per_node = num_gpus_per_node /
  model_parallel_size``; the batch and the counts are scaled back by ``dp_per_node``.
  If the current data-parallel size is not among them, the batch becomes the largest
  (or smallest) multiple of ``micro_batch * current_dp_size`` not above ``M``, and the
  only valid count is the current one.
"""
from __future__ import annotations

import json
import math
import os
from functools import lru_cache
from typing import List, Optional, Tuple

from packaging import version as pkg_version

from ..utils.logging import logger
from .config import ElasticityConfig, ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize
from .constants import (DEEPSPEED_ELASTICITY_CONFIG, ELASTICITY, ENABLED, ENABLED_DEFAULT,
                        LATEST_ELASTICITY_VERSION, MINIMUM_DEEPSPEED_VERSION)

#: DeepSpeed scales by highly composite numbers up to this one (its table ends here).
HCN_LIMIT = 720720


@lru_cache(maxsize=1)
def highly_composite_numbers(limit: int = HCN_LIMIT) -> Tuple[int, ...]:
    """Highly composite numbers ``<= limit``: each has more divisors than every smaller
    positive integer. Every one is a product of the first primes with non-increasing
    exponents, so only those products are searched."""
    primes = (2, 3, 5, 7, 11, 13, 17, 19)
    found = []  # (n, number of divisors)

    def walk(i, n, max_exp, divisors):
        found.append((n, divisors))
        if i == len(primes):
            return
        p, e = primes[i], 0
        while e < max_exp and n * p <= limit:
            n *= p
            e += 1
            walk(i + 1, n, e, divisors * (e + 1))

    walk(0, 1, 64, 1)
    result, best = [], 0
    for n, d in sorted(found):
        if d > best:
            result.append(n)
            best = d
    return tuple(result)


def _largest_hcn_at_most(value: int) -> int:
    hcn = highly_composite_numbers()
    return max(h for h in hcn if h <= value) if value >= 1 else hcn[0]


def get_candidate_batch_sizes(base_list: List[int], max_acceptable_batch_size: int) -> List[int]:
    """Each base not above the maximum, scaled by the largest highly composite number
    that keeps it at most ``max_acceptable_batch_size`` (duplicates removed)."""
    candidates = {int(base) * _largest_hcn_at_most(max_acceptable_batch_size // int(base))
                  for base in base_list if base <= max_acceptable_batch_size}
    return sorted(candidates)


def get_valid_gpus(batch_size: int, micro_batches: List[int], min_valid_gpus: int, max_valid_gpus: int) -> List[int]:
    """GPU counts ``g`` in ``[min_valid_gpus, max_valid_gpus]`` for which some micro batch
    ``m`` makes ``g * m`` divide ``batch_size`` (so ``batch_size = m * g * gas``)."""
    valid = set()
    for m in micro_batches:
        if batch_size % m:
            continue
        most = batch_size // m
        for g in range(max(1, min_valid_gpus), min(most, max_valid_gpus) + 1):
            if most % g == 0:
                valid.add(g)
    return sorted(valid)


def get_best_candidates(candidate_batch_sizes, micro_batches, min_gpus, max_gpus, prefer_larger):
    """The candidate with the most valid GPU counts; ties to the larger (or smaller) batch.
    Returns ``(batch_size, valid_gpus)``; with no candidate serving any GPU count, the
    batch is the smallest micro batch and ``valid_gpus`` is empty."""
    best_batch, best_gpus = int(min(micro_batches)), []
    for batch in candidate_batch_sizes:
        gpus = get_valid_gpus(batch, micro_batches, min_gpus, max_gpus)
        tie_better = batch > best_batch if prefer_larger else batch < best_batch
        if len(gpus) > len(best_gpus) or (len(gpus) == len(best_gpus) and tie_better):
            best_batch, best_gpus = batch, gpus
    return best_batch, best_gpus


def _get_compatible_gpus_v01(micro_batches, max_acceptable_batch_size, min_gpus=None, max_gpus=None,
                             prefer_larger=True):
    """Version 0.1: ``(final_batch_size, valid_gpus)`` (see the module docstring)."""
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or max_acceptable_batch_size // min(micro_batches)
    too_big = [m for m in micro_batches if m > max_acceptable_batch_size]
    if too_big:
        raise ElasticityConfigError(
            f"Every entry of 'elasticity.micro_batch_sizes' must be <= max_train_batch_size "
            f"({max_acceptable_batch_size}); {too_big} are larger.")
    lcm = math.lcm(*micro_batches)
    candidates = get_candidate_batch_sizes(list(micro_batches) + [lcm], max_acceptable_batch_size)
    logger.info(f"Elasticity candidate batch sizes: {candidates}")
    return get_best_candidates(candidates, micro_batches, min_gpus, max_gpus, prefer_larger)


def _first_fitting_micro_batch(micro_batches, per_gpu_batch, prefer_larger):
    """v0.2's pick: among micro batches dividing ``per_gpu_batch``, the largest if
    ``prefer_larger`` else the first listed; None if none divides."""
    fitting = [m for m in micro_batches if per_gpu_batch % m == 0]
    if not fitting:
        return None
    return max(fitting) if prefer_larger else fitting[0]


def _get_compatible_gpus_v02(micro_batches, max_acceptable_batch_size, current_num_gpus, min_gpus=None,
                             max_gpus=None, prefer_larger=True, num_gpus_per_node=1, model_parallel_size=1):
    """Version 0.2: ``(final_batch_size, valid_dp_world_sizes, micro_batch)``."""
    if num_gpus_per_node % model_parallel_size != 0:
        raise ElasticityError(
            f"In elasticity v0.2, 'elasticity.num_gpus_per_node' ({num_gpus_per_node}) must be divisible by "
            f"'elasticity.model_parallel_size' ({model_parallel_size}).")
    dp_per_node = num_gpus_per_node // model_parallel_size
    node_batch, valid_nodes = _get_compatible_gpus_v01(
        micro_batches, int(max_acceptable_batch_size / dp_per_node), int(min_gpus / num_gpus_per_node),
        int(max_gpus / num_gpus_per_node), prefer_larger=prefer_larger)
    final_batch = int(node_batch) * dp_per_node
    valid_dp = [n * dp_per_node for n in valid_nodes]
    if current_num_gpus // model_parallel_size in valid_dp:
        micro = _first_fitting_micro_batch(micro_batches, final_batch // current_num_gpus, prefer_larger)
        return final_batch, valid_dp, micro

    # The current size is not one of the planned ones: fit the batch to it instead.
    current_dp = (current_num_gpus / num_gpus_per_node) * dp_per_node
    fitted = [math.floor(max_acceptable_batch_size / float(m * current_dp)) * (m * current_dp)
              for m in micro_batches]
    batch = max(fitted) if prefer_larger else min(fitted)
    micro = _first_fitting_micro_batch(micro_batches, batch // current_num_gpus, prefer_larger)
    return batch, [int(current_dp)], micro


def _compatible_ds_version_check(target_deepspeed_version: str) -> bool:
    if pkg_version.parse(str(target_deepspeed_version)) < pkg_version.parse(MINIMUM_DEEPSPEED_VERSION):
        raise ElasticityError(
            f"Target deepspeed version {target_deepspeed_version} is older than {MINIMUM_DEEPSPEED_VERSION}, "
            f"the first version supporting elasticity.")
    return True


def elasticity_enabled(ds_config: dict) -> bool:
    """True when ``ds_config`` has an ``elasticity`` section with ``enabled`` true."""
    if ELASTICITY not in ds_config:
        return False
    return bool(ds_config[ELASTICITY].get(ENABLED, ENABLED_DEFAULT))


def ensure_immutable_elastic_config(runtime_elastic_config_dict: dict) -> None:
    """Refuse to run when the elastic section the resource scheduler planned with (JSON in
    ``$DEEPSPEED_ELASTICITY_CONFIG``) differs from the one given to the runtime in
    ``max_train_batch_size``, ``micro_batch_sizes`` or ``version``. Without the variable,
    warn: nothing guarantees the scheduler picks GPU counts this config can serve."""
    if DEEPSPEED_ELASTICITY_CONFIG not in os.environ:
        logger.warning(f"{DEEPSPEED_ELASTICITY_CONFIG} is not set: cannot check that the resource scheduler "
                       f"scales this job with GPU counts the elastic config supports.")
        return
    try:
        planned_dict = json.loads(os.environ[DEEPSPEED_ELASTICITY_CONFIG])
    except json.JSONDecodeError as e:
        raise ElasticityConfigError(f"${DEEPSPEED_ELASTICITY_CONFIG} is not valid JSON: {e}") from None
    planned = ElasticityConfig(planned_dict)
    runtime = ElasticityConfig(runtime_elastic_config_dict)
    for attr, key in (("max_acceptable_batch_size", "max_train_batch_size"), ("micro_batches", "micro_batch_sizes"),
                      ("version", "version")):
        if getattr(planned, attr) != getattr(runtime, attr):
            raise ElasticityConfigError(
                f"Elastic config '{key}' seen by the resource scheduler (${DEEPSPEED_ELASTICITY_CONFIG}) is "
                f"{getattr(planned, attr)!r} but the config passed to the runtime has {getattr(runtime, attr)!r}; "
                f"they must be the same.")


def _largest_dividing_micro_batch(micro_batches, per_gpu_batch) -> Optional[int]:
    for m in sorted(set(micro_batches), reverse=True):
        if per_gpu_batch % m == 0:
            return m
    return None


def compute_elastic_config(ds_config: dict, target_deepspeed_version: str, world_size: int = 0,
                           return_microbatch: bool = False):
    """Compute the elastic global batch size and the GPU counts that can train with it.

    Args:
        ds_config: a DeepSpeed config dict with an enabled ``elasticity`` section.
        target_deepspeed_version: the DeepSpeed version the job will run (>= 0.3.8).
        world_size: the current data-parallel world size; when > 0 it must be a valid
            count and the micro batch for it is returned too. Version 0.2 needs it (or
            ``$WORLD_SIZE``).
        return_microbatch: also return a micro batch size when ``world_size`` is 0.

    Returns:
        ``(final_batch_size, valid_gpus)``, or ``(final_batch_size, valid_gpus,
        micro_batch_size)`` when ``world_size > 0`` or ``return_microbatch``.

    Raises:
        ElasticityConfigError: the section is missing, disabled or invalid.
        ElasticityError: the target version predates elasticity, or v0.2's
            ``num_gpus_per_node`` is not a multiple of ``model_parallel_size``.
        ElasticityIncompatibleWorldSize: ``world_size`` is not a valid GPU count.
    """
    if not isinstance(ds_config, dict):
        raise ValueError(f"Expected ds_config to be a dict, got {type(ds_config).__name__}: {ds_config!r}")
    if ELASTICITY not in ds_config:
        raise ElasticityConfigError(f"'{ELASTICITY}' is missing from the config; add it to run an elastic job.")
    section = ds_config[ELASTICITY]
    if not isinstance(section, dict) or not section.get(ENABLED, ENABLED_DEFAULT):
        raise ElasticityConfigError("Elasticity is disabled: set 'elasticity.enabled' to true to run an "
                                    "elastic training job.")
    cfg = ElasticityConfig(section)
    ver = float(cfg.version)
    if cfg.model_parallel_size > 1 and ver != 0.2:
        raise ElasticityConfigError(
            f"Elasticity v{cfg.version} does not support model parallelism ('elasticity.model_parallel_size' = "
            f"{cfg.model_parallel_size}); use 'elasticity.version' 0.2.")
    if ver > LATEST_ELASTICITY_VERSION:
        raise ElasticityConfigError(f"'elasticity.version' {cfg.version} is newer than this runtime supports "
                                    f"(up to {LATEST_ELASTICITY_VERSION}).")
    _compatible_ds_version_check(target_deepspeed_version)

    if ver == 0.1:
        final_batch_size, valid_gpus = _get_compatible_gpus_v01(
            cfg.micro_batches, cfg.max_acceptable_batch_size, cfg.min_gpus, cfg.max_gpus,
            prefer_larger=cfg.prefer_larger_batch_size)
        v2_micro = None
    elif ver == 0.2:
        if world_size:
            current = world_size
        elif os.environ.get("WORLD_SIZE", "").isnumeric():
            current = int(os.environ["WORLD_SIZE"])
        else:
            raise ElasticityConfigError(
                "Elasticity v0.2 needs the world size to compute a valid batch size: pass world_size to "
                f"compute_elastic_config or set $WORLD_SIZE (it is {os.environ.get('WORLD_SIZE')!r}).")
        final_batch_size, valid_gpus, v2_micro = _get_compatible_gpus_v02(
            cfg.micro_batches, cfg.max_acceptable_batch_size, current, cfg.min_gpus, cfg.max_gpus,
            prefer_larger=cfg.prefer_larger_batch_size, num_gpus_per_node=cfg.num_gpus_per_node,
            model_parallel_size=cfg.model_parallel_size)
    else:
        raise ElasticityConfigError(f"'elasticity.version' must be 0.1 or 0.2, given {cfg.version!r}.")
    final_batch_size = int(final_batch_size)
    logger.info(f"Elasticity: valid world sizes (GPUs / model parallel size): {valid_gpus}")

    if world_size > 0:
        if world_size not in valid_gpus:
            raise ElasticityIncompatibleWorldSize(
                f"World size ({world_size}) is not valid for the elastic config: the batch size "
                f"{final_batch_size} supports these GPU counts: {valid_gpus}")
        micro = _largest_dividing_micro_batch(cfg.micro_batches, final_batch_size // world_size)
        if micro is None:
            raise ElasticityError(f"No micro batch in {cfg.micro_batches} divides the per-GPU batch "
                                  f"{final_batch_size // world_size} (batch {final_batch_size}, "
                                  f"world size {world_size}).")
        return final_batch_size, valid_gpus, micro
    if return_microbatch:
        if ver == 0.2:
            return final_batch_size, valid_gpus, v2_micro
        raise ElasticityConfigError("Elasticity v0.1 picks a micro batch for a given world size: pass world_size "
                                    "(> 0) together with return_microbatch=True.")
    return final_batch_size, valid_gpus

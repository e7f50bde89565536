"""compute_elastic_config against values worked out by hand from the documented algorithm.

Worked example (v0.1, max_train_batch_size 24, micro_batch_sizes [2, 3]):
  bases 2, 3 and lcm 6; scaled by the largest highly composite number h <= 24 // base:
  2 * 12 = 24, 3 * 6 = 18, 6 * 4 = 24  -> candidates {18, 24}.
  GPU counts g with g * m | B for some micro batch m:
    B = 24: m=2 -> divisors of 12 {1,2,3,4,6,12}; m=3 -> divisors of 8 {1,2,4,8}
            -> {1,2,3,4,6,8,12} (7 counts)
    B = 18: m=2 -> divisors of 9 {1,3,9};  m=3 -> divisors of 6 {1,2,3,6} -> 5 counts
  24 wins. At world size 8 the per-GPU batch is 3 -> micro batch 3; at 4 it is 6 -> 3.
"""
import pytest

from deepspeed.elasticity import (ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize,
                                  compute_elastic_config, elasticity_enabled)
from deepspeed.elasticity.elasticity import highly_composite_numbers

V = "0.19.6"


def cfg(**kw):
    section = {"enabled": True, "max_train_batch_size": 24, "micro_batch_sizes": [2, 3], "version": 0.1}
    section.update(kw)
    return {"elasticity": section}


def test_highly_composite_numbers_start():
    # OEIS A002182, checked by counting divisors by hand for the first few.
    assert highly_composite_numbers()[:12] == (1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240)
    assert highly_composite_numbers()[-1] == 720720


@pytest.mark.parametrize("kw, world, expected", [
    ({}, 0, (24, [1, 2, 3, 4, 6, 8, 12])),
    ({}, 8, (24, [1, 2, 3, 4, 6, 8, 12], 3)),
    ({}, 4, (24, [1, 2, 3, 4, 6, 8, 12], 3)),
    ({}, 12, (24, [1, 2, 3, 4, 6, 8, 12], 2)),       # per GPU 2 -> only micro batch 2 divides
    ({"min_gpus": 3, "max_gpus": 8}, 0, (24, [3, 4, 6, 8])),
    # max_train_batch_size 7, max_gpus 2: candidates 2*2=4 and 3*2=6 both serve {1, 2}: a tie.
    ({"max_train_batch_size": 7, "max_gpus": 2}, 0, (6, [1, 2])),
    ({"max_train_batch_size": 7, "max_gpus": 2, "prefer_larger_batch": False}, 0, (4, [1, 2])),
    ({"max_train_batch_size": 7, "max_gpus": 2, "prefer_large_batch": False}, 0, (4, [1, 2])),  # documented name
    # Without max_gpus the range ends at 7 // 2 = 3: 6 serves {1,2,3} (m=2: 3 -> {1,3}; m=3: 2 -> {1,2}).
    ({"max_train_batch_size": 7}, 0, (6, [1, 2, 3])),
])
def test_v01_table(kw, world, expected):
    assert compute_elastic_config(cfg(**kw), V, world_size=world) == expected


def test_v02_table(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # One GPU per node: same search as v0.1 (max_gpus 10000 keeps every count up to 12).
    assert compute_elastic_config(cfg(version=0.2), V, world_size=4) == (24, [1, 2, 3, 4, 6, 8, 12], 3)
    # World size 5 is not a planned count: batch refitted to 5 GPUs: m=2 -> floor(24/10)*10 = 20,
    # m=3 -> floor(24/15)*15 = 15; the larger, 20, per GPU 4 -> micro batch 2.
    assert compute_elastic_config(cfg(version=0.2), V, world_size=5) == (20, [5], 2)
    # 4 GPUs per node, model parallel 2 -> 2 data-parallel ranks per node: the search runs on
    # nodes with max batch 24 / 2 = 12: bases 2*6, 3*4, 6*2 all give 12; counts {1,2,3,4,6};
    # batch 12 * 2 = 24, data-parallel sizes {2,4,6,8,12}.
    section = dict(version=0.2, num_gpus_per_node=4, model_parallel_size=2)
    monkeypatch.setenv("WORLD_SIZE", "8")  # 8 GPUs -> dp 4, planned; per-GPU 24 // 8 = 3 -> micro 3
    assert compute_elastic_config(cfg(**section), V, return_microbatch=True) == (24, [2, 4, 6, 8, 12], 3)
    assert compute_elastic_config(cfg(**section), V) == (24, [2, 4, 6, 8, 12])


@pytest.mark.parametrize("config, exc, words", [
    ({}, ElasticityConfigError, "missing"),
    ({"elasticity": {"enabled": False}}, ElasticityConfigError, "enabled"),
    ({"elasticity": {"enabled": True}}, ElasticityConfigError, "max_train_batch_size"),
    (cfg(micro_batch_sizes=5), ElasticityConfigError, "micro_batch_sizes"),
    (cfg(micro_batch_sizes=[2, 0]), ElasticityConfigError, "micro_batch_sizes"),
    (cfg(micro_batch_sizes=[2, 0.5]), ElasticityConfigError, "micro_batch_sizes"),
    (cfg(min_gpus=4, max_gpus=2), ElasticityConfigError, "min_gpus"),
    (cfg(max_gpus=0), ElasticityConfigError, "max_gpus"),
    (cfg(model_parallel_size=2), ElasticityConfigError, "model_parallel_size"),
    (cfg(version=0.3), ElasticityConfigError, "0.3"),
    (cfg(version=0.15), ElasticityConfigError, "0.1 or 0.2"),
    (cfg(micro_batch_sizes=[2, 30]), ElasticityConfigError, "30"),
    (cfg(min_time=-1), ElasticityConfigError, "min_time"),
])
def test_bad_configs(config, exc, words):
    with pytest.raises(exc, match=words):
        compute_elastic_config(config, V)


def test_world_size_and_version_errors(monkeypatch):
    with pytest.raises(ElasticityIncompatibleWorldSize, match=r"World size \(5\).*\[1, 2, 3, 4, 6, 8, 12\]"):
        compute_elastic_config(cfg(), V, world_size=5)
    with pytest.raises(ElasticityError, match="num_gpus_per_node.*divisible"):
        compute_elastic_config(cfg(version=0.2, num_gpus_per_node=4, model_parallel_size=3), V, world_size=8)
    with pytest.raises(ElasticityError, match="0.3.8"):
        compute_elastic_config(cfg(), "0.3.7")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ElasticityConfigError, match="WORLD_SIZE"):
        compute_elastic_config(cfg(version=0.2), V)
    with pytest.raises(ElasticityConfigError, match="world_size"):
        compute_elastic_config(cfg(), V, return_microbatch=True)
    with pytest.raises(ValueError, match="dict"):
        compute_elastic_config("not a dict", V)
    assert elasticity_enabled(cfg()) and not elasticity_enabled({}) \
        and not elasticity_enabled({"elasticity": {"enabled": False}})

"""The ZeRO-3 leaf-module API's bookkeeping (the gathering behaviour is tested on two
ranks in test_surface_distributed.py)."""
import pytest
import torch.nn as nn

from deepspeed.runtime.zero.partitioned_param import module_params_to_fetch
from deepspeed.utils import (get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module,
                             z3_leaf_parameter)


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.other = nn.Linear(2, 2)


class Sub(Inner):  # a class matches its subclasses; a class *name* matches that exact class (DeepSpeed 0.19)
    pass


def test_set_get_unset_by_class_and_name():
    m = nn.Sequential(Outer(), Outer(), Sub())
    marked = set_z3_leaf_modules(m, [Inner])
    assert marked == [m[0].inner, m[1].inner, m[2]] and get_z3_leaf_modules(m) == marked
    assert z3_leaf_module(m[0].inner) and z3_leaf_module(m[2]) and not z3_leaf_module(m[0])
    assert z3_leaf_parameter(m[0].inner.lin.weight) and not z3_leaf_parameter(m[0].other.weight)
    assert m[0].inner.lin.weight.ds_z3_leaf_module is m[0].inner
    assert unset_z3_leaf_modules(m, ["Inner"]) == marked[:2] and get_z3_leaf_modules(m) == [m[2]]
    assert not z3_leaf_parameter(m[0].inner.lin.weight)
    assert unset_z3_leaf_modules(m, [f"{Sub.__module__}.{Sub.__qualname__}"]) == [m[2]]
    assert set_z3_leaf_modules(m, ["Sub"]) == [m[2]]


def test_leaf_by_name_suffix_and_config_section():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES
    from deepspeed.utils import set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix
    from deepspeed.utils.z3_leaf_module import apply_zero_leaf_module_config
    m = nn.Sequential(Outer(), Outer())
    assert set_z3_leaf_modules_by_name(m, ["0.inner", "nope"], raise_if_not_found=False) == ([m[0].inner], ["nope"])
    with pytest.raises(ValueError, match=r"No modules named \['nope'\]"):
        set_z3_leaf_modules_by_name(m, ["nope"])
    assert set_z3_leaf_modules_by_suffix(m, ["inner"], flag=False) == ([m[0].inner, m[1].inner], [])
    assert get_z3_leaf_modules(m) == []
    assert DeepSpeedZeroConfig().leaf_module.classes == DEFAULT_LEAF_MODULE_CLASSES
    cfg = DeepSpeedZeroConfig(leaf_module={"classes": "Inner", "name_suffixes": ["1.other", "1.other"]})
    assert cfg.leaf_module.classes == ["Inner"] and cfg.leaf_module.name_suffixes == ["1.other"]
    assert apply_zero_leaf_module_config(m, cfg.leaf_module) == [m[0].inner, m[1].inner, m[1].other]
    assert apply_zero_leaf_module_config(nn.Linear(2, 2), DeepSpeedZeroConfig().leaf_module) == []


def test_nested_leaf_and_errors():
    m = Outer()
    set_z3_leaf_modules(m, [Outer, Inner])
    # the outer leaf gathers for everything below it, the inner one is inside it
    assert m.inner.__dict__.get("_z3_inside_leaf") and not m.__dict__.get("_z3_inside_leaf")
    assert m.inner.lin.weight.ds_z3_leaf_module is m
    # unpartitioned parameters are never fetched, leaf or not
    assert module_params_to_fetch(m) == [] and module_params_to_fetch(m.inner) == []
    with pytest.raises(ValueError, match=r"No modules of type \['Linear2'\]"):
        set_z3_leaf_modules(m, ["Linear2"])
    assert set_z3_leaf_modules(m, ["Linear2"], raise_if_not_found=False) == []
    with pytest.raises(TypeError, match="classes or class names"):
        set_z3_leaf_modules(m, [3])
    with pytest.raises(TypeError, match="torch.nn.Module"):
        set_z3_leaf_modules("model", [Inner])

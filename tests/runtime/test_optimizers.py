"""The config optimizer factory: every type builds and matches its reference update; errors name the key."""
import pytest
import torch

from deepspeed.config.errors import DeepSpeedConfigError
from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.ops.lamb import FusedLamb
from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
from deepspeed.runtime.optimizers import build_optimizer, validate_optimizer_config
from tests.ops._common import assert_histories_close, tiny_model, train
from tests.ops.test_lamb import lamb_reference
from tests.ops.test_lion import lion_reference


def _torch(cls, **kw):
    return lambda m: cls(m.parameters(), **kw)


# (config type, config params, cpu_offload, expected class, reference: factory over a model or "lamb"/"lion")
CASES = [
    ("Adam", {"lr": 1e-2}, False, FusedAdam, _torch(torch.optim.AdamW, lr=1e-2, weight_decay=0.0)),
    ("Adam", {"lr": 1e-2, "weight_decay": 0.1}, False, FusedAdam,
     _torch(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)),  # adam_w_mode defaults to True
    ("Adam", {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False}, False, FusedAdam,
     _torch(torch.optim.Adam, lr=1e-2, weight_decay=0.1)),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.1, "betas": [0.8, 0.99]}, False, FusedAdam,
     _torch(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99))),
    ("adamw", {"lr": 1e-2, "weight_decay": 0.1}, True, DeepSpeedCPUAdam,
     _torch(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)),
    ("Adam", {"lr": 1e-2, "adam_w_mode": False, "weight_decay": 0.1}, True, DeepSpeedCPUAdam,
     _torch(torch.optim.Adam, lr=1e-2, weight_decay=0.1)),
    ("Adam", {"lr": 1e-2, "torch_adam": True, "weight_decay": 0.1}, False, torch.optim.AdamW,
     _torch(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)),
    ("Adam", {"lr": 1e-2, "torch_adam": True, "adam_w_mode": False, "amsgrad": True}, False, torch.optim.Adam,
     _torch(torch.optim.Adam, lr=1e-2, amsgrad=True)),
    ("Lamb", {"lr": 1e-2, "weight_decay": 0.01, "max_coeff": 0.5}, False, FusedLamb, "lamb"),
    ("Lion", {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.1}, False, FusedLion, "lion"),
    ("Lion", {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.1}, True, DeepSpeedCPULion, "lion"),
    ("Adagrad", {"lr": 0.1, "weight_decay": 0.1}, False, torch.optim.Adagrad,
     _torch(torch.optim.Adagrad, lr=0.1, weight_decay=0.1)),
    ("Adagrad", {"lr": 0.1, "eps": 1e-10}, True, DeepSpeedCPUAdagrad, _torch(torch.optim.Adagrad, lr=0.1)),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}, False, torch.optim.SGD,
     _torch(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True)),
    ("RMSprop", {"lr": 1e-2, "alpha": 0.9}, False, torch.optim.RMSprop,
     _torch(torch.optim.RMSprop, lr=1e-2, alpha=0.9)),
]


@pytest.mark.parametrize("type_name, params, offload, cls, reference", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_every_type_builds_and_matches_reference(type_name, params, offload, cls, reference):
    assert validate_optimizer_config(type_name, params).lower() == type_name.lower()
    model = tiny_model()
    _, opt, ours = train(model, lambda m: build_optimizer(type_name, params, m.parameters(), cpu_offload=offload))
    assert type(opt) is cls
    if reference == "lamb":
        ref = lamb_reference(model, 5, lr=1e-2, weight_decay=0.01, max_coeff=0.5)[0]
    elif reference == "lion":
        ref = lion_reference(model, 5, 1e-3, (0.9, 0.99), 0.1)
    else:
        ref = train(model, reference)[2]
    assert_histories_close(ours, ref, rtol=2e-6, atol=2e-7)


def test_param_groups_from_model_parameters():
    model = tiny_model()

    def groups(m):
        return [{"params": list(m[0].parameters()), "lr": 0.05}, {"params": list(m[2].parameters())}]

    _, opt, ours = train(model, lambda m: build_optimizer("AdamW", {"lr": 1e-2}, groups(m)))
    _, _, ref = train(model, lambda m: torch.optim.AdamW(groups(m), lr=1e-2, weight_decay=0.0))
    assert [g["lr"] for g in opt.param_groups] == [0.05, 1e-2]
    assert_histories_close(ours, ref)


def test_torch_optimizers_get_fused_or_foreach_kernels():
    params = tiny_model().parameters
    assert build_optimizer("SGD", {"lr": 0.1}, params()).defaults["fused"] is True
    assert build_optimizer("Adam", {"torch_adam": True}, params()).defaults["fused"] is True
    assert build_optimizer("RMSprop", {}, params()).defaults["foreach"] is True
    # an explicit choice in the config is respected
    assert build_optimizer("SGD", {"lr": 0.1, "foreach": False}, params()).defaults["fused"] is None


@pytest.mark.parametrize("type_name, params, fragments", [
    ("Adma", {}, ["optimizer.type 'Adma' is not a known optimizer", "Did you mean 'Adam'"]),
    ("", {}, ["optimizer.type must be a non-empty string"]),
    ("OneBitAdam", {"freeze_stp": 1}, ["optimizer.params.freeze_stp", "Did you mean 'freeze_step'"]),
    ("ZeroOneAdam", {"var_freeze_step": 1.5}, ["optimizer.params.var_freeze_step", "non-negative integer"]),
    ("onebitlamb", {"comm_backend_name": "hccl"}, ["optimizer.params.comm_backend_name", "'compressed'"]),
    ("Adam", {"lrr": 1e-3}, ["optimizer.params.lrr is not a parameter of optimizer 'Adam'", "Did you mean 'lr'"]),
    ("Lamb", {"max_coef": 1.0}, ["optimizer.params.max_coef", "Did you mean 'max_coeff'"]),
    ("Adam", {"lr": "auto"}, ["optimizer.params.lr = 'auto'", "non-negative number"]),
    ("Adam", {"betas": [0.9]}, ["optimizer.params.betas = [0.9]", "two numbers in [0, 1)"]),
    ("Adam", {"betas": [0.9, 1.0]}, ["optimizer.params.betas", "two numbers in [0, 1)"]),
    ("SGD", {"lr": -0.1}, ["optimizer.params.lr = -0.1", "non-negative"]),
    ("Adam", {"torch_adam": "yes"}, ["optimizer.params.torch_adam = 'yes'", "true or false"]),
    ("Adam", {"amsgrad": True}, ["optimizer.params.amsgrad = True", "torch_adam"]),
    ("AdamW", {"adam_w_mode": False}, ["optimizer.params.adam_w_mode = False contradicts", "type 'Adam'"]),
    ("Adam", {"torch_adam": True, "bias_correction": False}, ["optimizer.params.bias_correction = False",
                                                               "torch_adam"]),
    ("Lamb", {"min_coeff": 2.0, "max_coeff": 1.0}, ["optimizer.params.min_coeff (2.0) must not exceed"]),
    ("Lamb", {"amsgrad": True}, ["optimizer.params.amsgrad = True: Lamb has no amsgrad"]),
    ("SGD", {"lr": 0.1, "nesterov": True}, ["optimizer 'SGD' rejected optimizer.params", "Nesterov"]),
    ("Adam", [("lr", 1)], ["optimizer.params must be a dictionary"]),
])
def test_config_errors_name_the_key(type_name, params, fragments):
    with pytest.raises(DeepSpeedConfigError) as exc:
        validate_optimizer_config(type_name, params)
    for fragment in fragments:
        assert fragment in str(exc.value)


def test_build_checks_params_too():
    with pytest.raises(DeepSpeedConfigError, match="optimizer.params.momentun"):
        build_optimizer("SGD", {"lr": 0.1, "momentun": 0.9}, tiny_model().parameters())


def test_type_names_are_case_insensitive_and_canonicalised():
    assert validate_optimizer_config("ADAMW", {}) == "AdamW"
    assert validate_optimizer_config("rmsprop", {}) == "RMSprop"
    assert validate_optimizer_config("lamb", None) == "Lamb"

"""Each technique through the engine on a small BERT-like model: the loss stays within a
stated margin of the uncompressed run; ZeRO stages 0-2; data parallelism keeps the
pruning masks identical on every rank. Exhaustive, so ``slow`` (``make test-all``)."""
import pytest
import torch

import deepspeed
from deepspeed.compression import init_compression, redundancy_clean
from tests.compression.models import BertClassifier, bert_batches
from tests.helpers.dist import run_distributed

pytestmark = pytest.mark.slow

STEPS = 30
#: mean loss over the last 5 steps may exceed the uncompressed run's by at most this much
MARGIN = 0.12


def _group(params, modules, related=None):
    g = {"params": params, "modules": modules}
    if related is not None:
        g["related_modules"] = related
    return {"g": g}


TECHNIQUES = {
    "weight_quantization": {"weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "schedule_offset": 5},
        "different_groups": _group({"start_bits": 8, "target_bits": 4, "quantization_period": 4},
                                   ["attention.self", "attention.output", "intermediate",
                                    "layer.\\d+.output.dense"])}},
    "weight_quantization_asym_moq": {"weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": False, "schedule_offset": 5,
                              "quantization_type": "asymmetric", "quantize_groups": 2},
        "different_groups": _group({"start_bits": 8, "target_bits": 6, "quantization_period": 4},
                                   ["intermediate"])}},
    "activation_quantization": {"activation_quantization": {
        "shared_parameters": {"enabled": True, "schedule_offset": 5, "range_calibration": "static"},
        "different_groups": _group({"bits": 8}, ["attention.self", "intermediate", "layer.\\d+.output.dense"])}},
    "sparse_l1": {"sparse_pruning": {
        "shared_parameters": {"enabled": True, "method": "l1", "schedule_offset": 5},
        "different_groups": _group({"dense_ratio": 0.5}, ["attention.self", "intermediate"])}},
    "sparse_topk": {"sparse_pruning": {
        "shared_parameters": {"enabled": True, "method": "topk", "schedule_offset": 5},
        "different_groups": _group({"dense_ratio": 0.5}, ["attention.self", "intermediate"])}},
    "sparse_snip_2in4": {"sparse_pruning": {
        "shared_parameters": {"enabled": True, "method": "snip_momentum", "block_pattern": "2:4",
                              "schedule_offset": 5, "schedule_offset_end": 15, "schedule_offset_stride": 5,
                              "excluded_modules": ["classifier"]},
        "different_groups": {}}},
    "row_pruning": {"row_pruning": {
        "shared_parameters": {"enabled": True, "method": "l1", "schedule_offset": 5},
        "different_groups": _group({"dense_ratio": 0.5}, ["intermediate.dense"], [["layer.\\w+.output.dense"]])}},
    "head_pruning": {"head_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 5, "num_heads": 4},
        "different_groups": _group({"dense_ratio": 0.5}, ["attention.output.dense"],
                                   [["self.query", "self.key", "self.value"]])}},
}


def _train(compression, stage=0, bf16=False, seed=0):
    cfg = {"train_batch_size": 16, "steps_per_print": 0, "gradient_clipping": 0.0,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "zero_optimization": {"stage": stage}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if compression:
        cfg["compression_training"] = compression
    torch.manual_seed(seed)
    model = BertClassifier()
    if compression:
        init_compression(model, cfg)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    losses = []
    for x, y in bert_batches(STEPS):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses, cfg


@pytest.fixture(scope="module")
def reference_losses():
    return _train(None)[1]


@pytest.mark.parametrize("name", list(TECHNIQUES))
def test_each_technique_stays_near_the_uncompressed_run(name, reference_losses):
    engine, losses, cfg = _train(TECHNIQUES[name], stage=1 if "moq" in name else 0)
    tail, ref_tail = sum(losses[-5:]) / 5, sum(reference_losses[-5:]) / 5
    assert tail < sum(losses[:3]) / 3 - 0.1, losses
    assert tail - ref_tail < MARGIN, (name, losses, reference_losses)
    # and the cleaned model computes what the trained, masked model computes
    x, _ = bert_batches(1, seed=9)[0]
    engine.eval()
    masked = engine(x).detach()
    redundancy_clean(engine.module, cfg)
    torch.testing.assert_close(engine.module(x), masked, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stage,bf16", [(0, True), (1, False), (2, False), (2, True)])
def test_zero_stages(stage, bf16):
    comp = dict(TECHNIQUES["row_pruning"], **TECHNIQUES["weight_quantization_asym_moq"])
    engine, losses, _ = _train(comp, stage=stage, bf16=bf16)
    assert sum(losses[-5:]) / 5 < sum(losses[:3]) / 3 - 0.1, losses
    assert engine.compression_scheduler.training_steps == STEPS


def _dp_snip_body(rank, world_size):
    comp = TECHNIQUES["sparse_snip_2in4"]
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 0,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 2},
           "compression_training": comp}
    torch.manual_seed(0)
    model = BertClassifier()
    init_compression(model, cfg)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    for x, y in bert_batches(16, batch=8, seed=10 + rank):  # each rank its own data: local scores differ
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    return {n: b.clone() for n, b in engine.module.named_buffers() if n.endswith("sparse_pruning_mask")}


def test_data_parallel_ranks_prune_the_same_weights():
    masks = run_distributed(_dp_snip_body, world_size=2, timeout=240)
    assert masks[0].keys() == masks[1].keys() and masks[0]
    for n in masks[0]:
        assert torch.equal(masks[0][n], masks[1][n]), n
        m = masks[0][n].reshape(masks[0][n].size(0), -1, 4)
        assert torch.all(m.sum(-1) == 2), n  # 2:4 everywhere


def _cnn_run(compression):
    from tests.compression.models import SmallCNN
    cfg = {"train_batch_size": 16, "steps_per_print": 0, "gradient_clipping": 0.0,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    if compression:
        cfg["compression_training"] = compression
    torch.manual_seed(0)
    model = SmallCNN()
    if compression:
        init_compression(model, cfg)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(16, 3, 6, 6, generator=g)
        y = (x[:, 0].mean((1, 2)) > 0).long() + (x[:, 1].mean((1, 2)) > 0).long()
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses, cfg


@pytest.mark.parametrize("method", ["l1", "topk"])
def test_cnn_channel_pruning_stays_near_the_uncompressed_run(method):
    comp = {"channel_pruning": {"shared_parameters": {"enabled": True, "method": method, "schedule_offset": 5},
                                "different_groups": _group({"dense_ratio": 0.5}, ["conv1"], [["conv2", "bn1"]])}}
    engine, losses, cfg = _cnn_run(comp)
    _, ref, _ = _cnn_run(None)
    tail, ref_tail = sum(losses[-5:]) / 5, sum(ref[-5:]) / 5
    assert tail < sum(losses[:3]) / 3 - 0.1, losses
    assert tail - ref_tail < MARGIN, (losses, ref)
    engine.eval()
    x = torch.randn(4, 3, 6, 6)
    masked = engine(x).detach()
    redundancy_clean(engine.module, cfg)
    assert engine.module.conv1.out_channels == 4 and engine.module.conv2.weight.shape[1] == 4
    torch.testing.assert_close(engine.module(x), masked, rtol=1e-4, atol=1e-5)


def test_layer_reduction_with_distillation_through_the_engine():
    """The tutorial's recipe: a 2-layer student from teacher layers 1 and 3, trained on
    cross-entropy + KL to the teacher's logits; the student ends closer to the teacher."""
    teacher, _, _ = _train(None)  # a 2-layer model trained STEPS steps serves as the teacher
    from tests.compression.models import BertClassifier as _B
    big = _B(layers=4)
    with torch.no_grad():  # a 4-layer teacher whose layers 1 and 3 are the trained ones
        for i in (1, 3):
            big.bert.encoder.layer[i].load_state_dict(teacher.module.bert.encoder.layer[i // 2].state_dict())
        big.bert.embeddings.load_state_dict(teacher.module.bert.embeddings.state_dict())
        big.classifier.load_state_dict(teacher.module.classifier.state_dict())
    comp = {"layer_reduction": {"enabled": True, "keep_number_layer": 2, "module_name_prefix": "bert.encoder.layer",
                                "teacher_layer": [1, 3], "other_module_name": ["bert.embeddings", "classifier"]}}
    cfg = {"train_batch_size": 16, "steps_per_print": 0, "optimizer": {"type": "Adam", "params": {"lr": 0.003}},
           "compression_training": comp}
    torch.manual_seed(1)
    student = init_compression(_B(layers=2), cfg, teacher_model=big)
    x0, _ = bert_batches(1, seed=7)[0]
    with torch.no_grad():  # initialised from the teacher's kept layers: the trained 2-layer model exactly
        torch.testing.assert_close(student(x0), teacher.module.eval()(x0))
    kd = torch.nn.functional.kl_div

    def distill(model, config):
        engine, *_ = deepspeed.initialize(model=model, config=config)
        for x, y in bert_batches(10, seed=8):
            logits = engine(x)
            with torch.no_grad():
                t = teacher.module(x)
            loss = torch.nn.functional.cross_entropy(logits, y) + kd(logits.log_softmax(-1), t.log_softmax(-1),
                                                                     log_target=True, reduction="batchmean")
            engine.backward(loss)
            engine.step()
        engine.eval()
        with torch.no_grad():
            xs = torch.cat([x for x, _ in bert_batches(4, seed=9)])
            return kd(engine(xs).log_softmax(-1), teacher.module(xs).log_softmax(-1), log_target=True,
                      reduction="batchmean").item()

    reduced = distill(student, cfg)
    torch.manual_seed(1)
    scratch = distill(_B(layers=2), {k: v for k, v in cfg.items() if k != "compression_training"})
    assert reduced < scratch / 4, (reduced, scratch)  # the student starts from the teacher and stays near it


def test_fp16_overflow_steps_do_not_advance_the_schedule():
    comp = dict(TECHNIQUES["row_pruning"], **TECHNIQUES["weight_quantization_asym_moq"])
    cfg = {"train_batch_size": 16, "steps_per_print": 0, "fp16": {"enabled": True, "initial_scale_power": 30},
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 2},
           "compression_training": comp}
    torch.manual_seed(0)
    model = BertClassifier()
    init_compression(model, cfg)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    losses = []
    for x, y in bert_batches(STEPS):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert engine.skipped_steps > 0  # the loss scale starts at 2**30: the first steps overflow
    assert engine.compression_scheduler.training_steps == engine.global_steps - engine.skipped_steps
    assert sum(losses[-5:]) / 5 < sum(losses[:3]) / 3 - 0.1, losses

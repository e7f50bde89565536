"""Layer reduction: the student starts from exactly the named teacher layers."""
import pytest
import torch

from deepspeed.compression import init_compression
from tests.compression.models import BertClassifier


def _cfg(**over):
    lr = {"enabled": True, "keep_number_layer": 2, "module_name_prefix": "bert.encoder.layer",
          "teacher_layer": [1, 3], "other_module_name": ["bert.embeddings", "classifier"]}
    lr.update(over)
    return {"compression_training": {"layer_reduction": lr}}


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_student_copies_exactly_the_named_teacher_layers():
    torch.manual_seed(0)
    teacher, student = BertClassifier(layers=4), BertClassifier(layers=2)
    teacher_before = {k: v.clone() for k, v in teacher.state_dict().items()}
    init_compression(student, _cfg(), teacher_model=teacher)
    t_layers, s_layers = teacher.bert.encoder.layer, student.bert.encoder.layer
    assert _same(s_layers[0], t_layers[1]) and _same(s_layers[1], t_layers[3])
    assert not _same(s_layers[0], t_layers[0]) and not _same(s_layers[1], t_layers[2])
    assert _same(student.bert.embeddings, teacher.bert.embeddings) and _same(student.classifier, teacher.classifier)
    assert all(torch.equal(v, teacher_before[k]) for k, v in teacher.state_dict().items())  # teacher untouched
    # the student now computes what the teacher's layers 1 and 3 compute on the same input
    x = torch.randn(2, 6, 16)
    torch.testing.assert_close(s_layers[1](s_layers[0](x)), t_layers[3](t_layers[1](x)))


def test_layer_reduction_errors_name_the_problem():
    teacher, student = BertClassifier(layers=4), BertClassifier(layers=2)
    with pytest.raises(ValueError, match="teacher model"):
        init_compression(student, _cfg())
    with pytest.raises(ValueError, match="keep_number_layer is 3"):
        init_compression(BertClassifier(layers=2), _cfg(keep_number_layer=3, teacher_layer=[0, 1, 2]),
                         teacher_model=teacher)
    with pytest.raises(ValueError, match="teacher has no module 'bert.encoder.layer.7'"):
        init_compression(student, _cfg(teacher_layer=[1, 7]), teacher_model=teacher)
    from deepspeed.config.errors import DeepSpeedConfigError
    with pytest.raises(DeepSpeedConfigError, match="teacher_layer has 3 entries"):
        init_compression(student, _cfg(teacher_layer=[0, 1, 2]), teacher_model=teacher)

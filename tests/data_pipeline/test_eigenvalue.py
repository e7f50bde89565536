"""The eigenvalue estimator on a model whose Hessian is known in closed form."""
import pytest
import torch

from deepspeed.runtime.eigenvalue import Eigenvalue


class QuadBlock(torch.nn.Module):
    """loss_k = 1/2 w^T A w + b^T w: the Hessian w.r.t. w is A."""

    def __init__(self, A, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("A", A)
        self.w = torch.nn.Parameter(torch.randn(A.shape[0], generator=g))
        self.b = torch.randn(A.shape[0], generator=g)

    def loss(self):
        return 0.5 * self.w @ self.A @ self.w + self.b @ self.w


class Quad(torch.nn.Module):
    def __init__(self, mats):
        super().__init__()
        self.blocks = torch.nn.ModuleList([QuadBlock(A, i) for i, A in enumerate(mats)])

    def forward(self):
        return sum(b.loss() for b in self.blocks)


def _spd(n, top, seed):
    """A symmetric positive definite matrix with eigenvalues ``top`` > 1 > the rest."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    eig = torch.cat([torch.tensor([top], dtype=torch.float64), torch.linspace(0.1, 0.5, n - 1, dtype=torch.float64)])
    return (q @ torch.diag(eig) @ q.T).float()


@pytest.mark.filterwarnings(r"ignore:Using backward\(\) with create_graph")
def test_power_iteration_finds_the_largest_hessian_eigenvalue():
    mats = [_spd(6, 3.0, 0), _spd(6, 7.5, 1)]
    model = Quad(mats)
    truth = [torch.linalg.eigvalsh(A.double()).max().item() for A in mats]
    ev = Eigenvalue(max_iter=200, tol=1e-6, stability=0, layer_name="blocks", layer_num=2)
    out = ev.compute_eigenvalue_from_loss(model(), model)
    assert ev.last_eigenvalues == pytest.approx(truth, rel=1e-3)
    # DeepSpeed's form: per parameter (value scaled by the largest magnitude, block index)
    assert out[id(model.blocks[0].w)] == pytest.approx((truth[0] / truth[1], 0), rel=1e-3)
    assert out[id(model.blocks[1].w)] == pytest.approx((1.0, 1))
    # DeepSpeed's entry point: gradients that keep their graph
    loss = model()
    loss.backward(create_graph=True)
    ev.compute_eigenvalue(model)
    assert ev.last_eigenvalues == pytest.approx(truth, rel=1e-3)
    for p in model.parameters():
        p.grad = None


def test_linear_regression_hessian():
    # MSE of a linear layer: H = 2/N X^T X (per output row), largest eigenvalue known
    g = torch.Generator().manual_seed(3)
    X, Y = torch.randn(64, 5, generator=g), torch.randn(64, 1, generator=g)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(5, 1, bias=False)])
    loss = ((model.layers[0](X) - Y) ** 2).mean()
    ev = Eigenvalue(max_iter=300, tol=1e-7, layer_name="layers", layer_num=1)
    ev.compute_eigenvalue_from_loss(loss, model)
    truth = torch.linalg.eigvalsh(2.0 / 64 * X.T.double() @ X.double()).max().item()
    assert ev.last_eigenvalues[0] == pytest.approx(truth, rel=1e-3)


def test_bad_layer_name_and_num():
    model = Quad([_spd(3, 2.0, 0)])
    with pytest.raises(ValueError, match="layer_name 'encoder.layer'"):
        Eigenvalue(layer_name="encoder.layer", layer_num=1).get_layers(model)
    with pytest.raises(ValueError, match="layer_num is 2"):
        Eigenvalue(layer_name="blocks", layer_num=2).get_layers(model)
    with pytest.raises(ValueError, match="layer_num"):
        Eigenvalue(layer_name="blocks", layer_num=0)

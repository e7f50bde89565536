"""Gates and the dispatch/combine layer of Mixture of Experts.

Gating (per forward call, over the ``S`` tokens this rank holds, ``E`` experts):

* **top-1** (Switch): each token goes to its argmax expert with weight = its softmax
  probability. Capacity ``C = max(ceil(S / E * capacity_factor), min_capacity)``.
* **top-2** (GShard): first and second choice (the second chosen on Gumbel-noised logits
  when ``top2_2nd_expert_sampling``); weights renormalised over the kept choices;
  ``C = max(ceil(2 S / E * capacity_factor), min_capacity)``; every first choice is
  placed before any second choice.
* **top-k** (k > 2, ``topkgating``): the ``k`` most probable experts; weights renormalised over
  the kept choices; ``C = max(ceil(k S / E * capacity_factor), min_capacity)``. Over capacity,
  ``drop_policy="probs"`` (DeepSpeed's default) keeps each expert's ``C`` routes with the largest
  gate values, ``"position"`` its first ``C`` tokens; an expert's slots follow token order.

Token dropping: an expert keeps at most ``C`` assignments. Without random token
selection the earliest tokens win (position order); with ``use_rts`` (top-1) the
survivors are a uniformly random subset. ``drop_tokens=False`` keeps every assignment
(``C`` becomes the largest per-expert count over the expert-parallel group).
Load-balancing loss: top-1 ``E * sum_e(me_e * ce_e)`` where ``me`` is the mean gate
probability and ``ce`` the fraction of tokens whose first choice is ``e``; top-2
``E^2 * mean_e(me_e * ce_e)``; top-k ``E^2 / k * mean_e(me_e * ce_e)`` with ``ce`` over all
``k`` choices. Noise (``noisy_gate_policy``): ``"Jitter"`` multiplies the gate input by
U(1-1e-2, 1+1e-2); ``"RSample"`` adds Gumbel noise to the logits used to pick the
top-1 expert. All randomness comes from torch's global generator (seeded: repeatable).

Dispatch/combine: the gate returns DeepSpeed's dense ``combine_weights`` /
``dispatch_mask`` of shape ``[S, E, C]`` (or, with ``sparse_routes=True``, DeepSpeed 0.19's
per-route form ``(l_aux, C, E, indices, locations, gates, exp_counts)``, ``[k, S]`` each, which
``_route_slots`` / ``_sparse_encode`` / ``_sparse_decode`` turn into the expert input and the
combined output without the ``[S, E, C]`` tensors). ``MOELayer`` sends only the occupied slots
(expert-major, slot order) to the ranks that own those experts with one
``all_to_all_single`` whose split sizes are the exact per-rank counts (uneven when the
routing is), runs each local expert on its tokens (also when it got none, so every
expert parameter gets a gradient and no reduction waits), sends the results back the
same way and sums them into each token weighted by its gate weight.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

# DeepSpeed imports Microsoft's tutel here when installed (a fused dispatch for top-1 gating); this
# version never uses it, so use_tutel=True is refused and this stays False.
TUTEL_INSTALLED = False


def multiplicative_jitter(x: torch.Tensor, epsilon: float = 1e-2, device=None) -> torch.Tensor:
    """``x`` times U(1 - epsilon, 1 + epsilon) noise (Switch Transformer's jitter)."""
    if epsilon == 0:
        return x
    noise = torch.empty_like(x).uniform_(1.0 - epsilon, 1.0 + epsilon)
    return x * noise


def gumbel_rsample(shape, device) -> torch.Tensor:
    u = torch.rand(shape, device=device).clamp_(1e-20, 1.0 - 1e-7)
    return -torch.log(-torch.log(u))


def _capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    return max(int(math.ceil(num_tokens / num_experts * capacity_factor)), int(min_capacity))


def _max_over_group(value: int, group) -> int:
    if group is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return value
    from .. import comm as ds_comm
    t = ds_comm.to_comm_device(torch.tensor([value], dtype=torch.int64), group)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def _positions(choice_masks, capacity: Optional[int]):
    """Slots for a sequence of ``[S, E]`` 0/1 masks (choice 1 of every token, then choice
    2, ...): earlier choices and earlier tokens first. Returns (kept masks, slot index per
    mask as ``[S]`` long)."""
    kept, slots = [], []
    base = torch.zeros(choice_masks[0].shape[1], dtype=torch.long, device=choice_masks[0].device)
    for m in choice_masks:
        loc = torch.cumsum(m, dim=0) - 1 + base
        if capacity is not None:
            m = m * (loc < capacity).long()
        kept.append(m)
        slots.append((loc * m).sum(dim=1))
        base = base + m.sum(dim=0)
    return kept, slots


def _assemble(weights, kept, slots, num_experts, capacity, dense=True):
    """combine_weights ``[S, E, C]`` and dispatch mask from per-choice weights ``[S]``, kept
    masks ``[S, E]`` and slots ``[S]``; also the sparse form ``(expert, slot, token, weight)``
    of the occupied slots, sorted expert-major then by slot (what MOELayer sends)."""
    S = kept[0].shape[0]
    es, cs, ss, ws = [], [], [], []
    for w, m, loc in zip(weights, kept, slots):
        tok = m.sum(dim=1).nonzero(as_tuple=True)[0]
        es.append(m[tok].argmax(dim=1))
        cs.append(loc[tok])
        ss.append(tok)
        ws.append(w[tok])
    e_idx, c_idx, s_idx, w = torch.cat(es), torch.cat(cs), torch.cat(ss), torch.cat(ws)
    order = torch.argsort(e_idx * max(capacity, 1) + c_idx)
    e_idx, c_idx, s_idx, w = e_idx[order], c_idx[order], s_idx[order], w[order]
    if not dense:   # MOELayer needs only the sparse form: filling [S, E, C] costs ~100x the gate's matmul
        return None, None, (e_idx, c_idx, s_idx, w)
    combine = torch.zeros(S, num_experts, capacity, dtype=weights[0].dtype, device=kept[0].device)
    combine.index_put_((s_idx, e_idx, c_idx), w)
    dispatch = torch.zeros(S, num_experts, capacity, dtype=torch.bool, device=kept[0].device)
    dispatch[s_idx, e_idx, c_idx] = True
    return combine, dispatch, (e_idx, c_idx, s_idx, w)


def _routes(kept, slots, weights, capacity, num_experts, exp_counts, l_aux):
    """DeepSpeed's ``sparse_routes=True`` result: ``(l_aux, capacity, num_experts, indices, locations,
    gates, exp_counts)`` with one row per choice (``[k, S]``): the expert of each route (int32, -1 when
    the capacity limit evicted it), its slot in that expert's buffer (int32, 0 when evicted) and its
    combine weight (0 when evicted)."""
    idx = torch.stack([torch.where(m.sum(dim=1) > 0, m.argmax(dim=1), torch.full_like(m[:, 0], -1))
                       for m in kept]).to(torch.int32)
    return (l_aux, capacity, num_experts, idx, torch.stack(slots).to(torch.int32), torch.stack(weights), exp_counts)


def _route_slots(indices: torch.Tensor, locations: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Flat slot ``expert * capacity + location`` of every route in the ``[E * C]`` expert buffer
    (``[k, S]`` long); an evicted route (expert -1) points at the extra slot ``E * C``."""
    flat = indices.long() * capacity + locations.long()
    return torch.where(indices >= 0, flat, torch.full_like(flat, num_experts * capacity))


def _sparse_encode(reshaped_input: torch.Tensor, slots: torch.Tensor, num_experts: int,
                   capacity: int) -> torch.Tensor:
    """The ``[E, C, M]`` expert input: token ``s`` copied to every slot its routes hold, zeros in
    the slots nothing was routed to (what the dense ``einsum('sec,sm->ecm', dispatch_mask, x)`` gives)."""
    num_tokens, d_model = reshaped_input.shape
    buf = reshaped_input.new_zeros(num_experts * capacity + 1, d_model)      # + the eviction slot
    tokens = torch.arange(num_tokens, device=slots.device).expand_as(slots)
    buf.index_copy_(0, slots.reshape(-1), reshaped_input.index_select(0, tokens.reshape(-1)))
    return buf[:-1].view(num_experts, capacity, d_model)


def _sparse_decode(expert_output: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor,
                   num_tokens: int) -> torch.Tensor:
    """``[S, M]``: each token's expert outputs (``expert_output`` is ``[E * C, M]``) weighted by its
    routes' gates and summed, in fp32, cast back to the output's dtype (the dense
    ``einsum('sec,ecm->sm', combine_weights, y)``); evicted routes contribute nothing."""
    d_model = expert_output.shape[-1]
    padded = torch.cat([expert_output, expert_output.new_zeros(1, d_model)])
    picked = padded.index_select(0, slots.reshape(-1)).view(slots.shape[0], num_tokens, d_model)
    return (picked.float() * gates.float().unsqueeze(-1)).sum(dim=0).to(expert_output.dtype)


def top1gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, used_token=None,
               noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group=None, sparse_routes: bool = False, use_tutel: bool = False, *,
               return_assignments: bool = False, dense: bool = True):
    if use_tutel:   # DeepSpeed's keyword: Tutel's fused dispatch format, which needs the tutel package
        raise ValueError("top1gating(use_tutel=True) needs Microsoft's tutel package, which this deepspeed does not "
                         "use (TUTEL_INSTALLED is False); call it with use_tutel=False.")
    S, E = logits.shape
    gates = F.softmax(logits, dim=1)
    pick_from = logits + gumbel_rsample(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    idx = torch.argmax(pick_from, dim=1)
    mask = F.one_hot(idx, E).long()
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).long()
    exp_counts = mask.sum(dim=0).detach().cpu()
    me = gates.mean(dim=0)
    ce = mask.float().mean(dim=0)
    l_aux = torch.sum(me * ce) * E
    if drop_tokens:
        capacity = _capacity(S, E, capacity_factor, min_capacity)
        if use_rts:
            # keep a uniformly random subset of each expert's tokens
            score = mask.float() * torch.rand(mask.shape, device=mask.device)
            k = min(capacity, S)
            top = torch.topk(score, k=k, dim=0).indices
            keep = torch.zeros_like(mask).scatter_(0, top, 1)
            mask = mask * keep
            capacity_for_pos = None
        else:
            capacity_for_pos = capacity
    else:
        capacity = max(_max_over_group(int(mask.sum(dim=0).max().item()), ep_group), 1)
        capacity_for_pos = None
    kept, slots = _positions([mask], capacity_for_pos)
    weights = [(gates * kept[0]).sum(dim=1)]
    if sparse_routes:
        return _routes(kept, slots, weights, capacity, E, exp_counts, l_aux)
    combine, dispatch, sparse = _assemble(weights, kept, slots, E, capacity, dense)
    return (l_aux, combine, dispatch, exp_counts) + ((sparse,) if return_assignments else ())


def top2gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group=None, top2_2nd_expert_sampling: bool = True, sparse_routes: bool = False, *,
               return_assignments: bool = False, dense: bool = True):
    S, E = logits.shape
    gates = F.softmax(logits, dim=1)
    idx1 = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(idx1, E).long()
    noisy = logits + gumbel_rsample(logits.shape, logits.device) if top2_2nd_expert_sampling else logits
    idx2 = torch.argmax(noisy.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(idx2, E).long()
    exp_counts = (mask1 + mask2).sum(dim=0).detach().cpu()
    me = gates.mean(dim=0)
    ce = mask1.float().mean(dim=0)
    l_aux = torch.mean(me * ce) * E * E
    if drop_tokens:
        capacity = _capacity(S, E, 2 * capacity_factor, min_capacity)
        kept, slots = _positions([mask1, mask2], capacity)
    else:
        capacity = max(_max_over_group(int((mask1 + mask2).sum(dim=0).max().item()), ep_group), 1)
        kept, slots = _positions([mask1, mask2], None)
    g1 = (gates * kept[0]).sum(dim=1)
    g2 = (gates * kept[1]).sum(dim=1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(gates.dtype).eps)
    if sparse_routes:
        return _routes(kept, slots, [g1 / denom, g2 / denom], capacity, E, exp_counts, l_aux)
    combine, dispatch, sparse = _assemble([g1 / denom, g2 / denom], kept, slots, E, capacity, dense)
    return (l_aux, combine, dispatch, exp_counts) + ((sparse,) if return_assignments else ())


def topkgating(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group=None, drop_policy: str = "probs", sparse_routes: bool = False, *,
               return_assignments: bool = False, dense: bool = True):
    S, E = logits.shape
    if not 1 <= k <= E:
        raise ValueError(f"TopKGate: k={k} must be between 1 and num_experts={E}.")
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"topkgating: drop_policy must be 'probs' or 'position', got {drop_policy!r}")
    gates = F.softmax(logits, dim=1)
    top_gate, top = torch.topk(gates, k=k, dim=1)             # [S, k], best first
    chosen = torch.zeros(S, E, dtype=torch.long, device=logits.device).scatter_(1, top, 1)
    exp_counts = chosen.sum(dim=0).detach().cpu()
    me = gates.mean(dim=0)
    ce = chosen.float().mean(dim=0)
    l_aux = torch.mean(me * ce) * E * E / k
    if drop_tokens:
        capacity = _capacity(S, E, k * capacity_factor, min_capacity)
        if drop_policy == "probs":     # each expert keeps the `capacity` routes with the largest gate values
            score = torch.zeros_like(gates).scatter(1, top, top_gate)
            best = torch.topk(score, k=min(capacity, S), dim=0, sorted=False).indices
            chosen = chosen * torch.zeros_like(chosen).scatter_(0, best, 1)
        else:                          # "position": each expert keeps its first `capacity` tokens
            chosen = chosen * ((torch.cumsum(chosen, dim=0) - 1) < capacity).long()
    else:
        capacity = max(_max_over_group(int(chosen.sum(dim=0).max().item()), ep_group), 1)
    # slots in token order over every kept route of an expert (DeepSpeed's layout)
    where_ = (torch.cumsum(chosen, dim=0) - 1) * chosen
    kept = [F.one_hot(top[:, i], E).long() * chosen for i in range(k)]
    slots = [(where_ * m).sum(dim=1) for m in kept]
    ws = [(gates * m).sum(dim=1) for m in kept]
    denom = torch.clamp(sum(ws), min=torch.finfo(gates.dtype).eps)
    ws = [w / denom for w in ws]
    if sparse_routes:
        return _routes(kept, slots, ws, capacity, E, exp_counts, l_aux)
    combine, dispatch, sparse = _assemble(ws, kept, slots, E, capacity, dense)
    return (l_aux, combine, dispatch, exp_counts) + ((sparse,) if return_assignments else ())


class TopKGate(torch.nn.Module):
    """Gate network ``wg`` (fp32 linear, no bias) plus the routing rule (module docstring).

    ``forward(input, used_token=None)`` -> ``(l_aux, combine_weights, dispatch_mask, exp_counts)``.
    """

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group=None, top2_2nd_expert_sampling: bool = True):
        super().__init__()
        if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
            raise ValueError(f"noisy_gate_policy must be None, 'Jitter' or 'RSample', got {noisy_gate_policy!r}.")
        if k < 1 or k > num_experts:
            raise ValueError(f"TopKGate: k={k} must be between 1 and num_experts={num_experts}.")
        if capacity_factor <= 0 or eval_capacity_factor <= 0:
            raise ValueError(f"capacity_factor ({capacity_factor}) and eval_capacity_factor "
                             f"({eval_capacity_factor}) must be > 0.")
        if min_capacity < 0:
            raise ValueError(f"min_capacity must be >= 0, got {min_capacity}.")
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False).float()
        self.k = k
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.ep_group = ep_group
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown = False
        self.gate_time = 0.0
        self.last_assignments = None

    def _set_ep_group(self, ep_group):
        self.ep_group = ep_group

    def forward(self, input: torch.Tensor, used_token: Optional[torch.Tensor] = None, sparse_routes: bool = False,
                use_tutel: bool = False):
        """DeepSpeed's contract: ``(l_aux, combine_weights, dispatch_mask, exp_counts)``; with
        ``sparse_routes`` the per-route form ``(l_aux, capacity, num_experts, indices, locations,
        gates, exp_counts)`` (see ``_routes``)."""
        if use_tutel:
            raise ValueError("TopKGate(use_tutel=True) needs Microsoft's tutel package, which this deepspeed does "
                             "not use (TUTEL_INSTALLED is False).")
        if sparse_routes:
            return self._route(input, used_token, sparse_routes=True)
        return self._route(input, used_token, dense=True)

    def _route(self, input, used_token=None, dense=True, sparse_routes=False):
        """Routing; also leaves the sparse form (expert, slot, token, weight) of the occupied
        slots in ``last_assignments``. ``dense=False`` skips the [S, E, C] tensors (None)."""
        t0 = time.perf_counter() if self.wall_clock_breakdown else None
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x)
        logits = F.linear(x, self.wg.weight.float())
        cf = self.capacity_factor if self.training else self.eval_capacity_factor
        ask = dict(sparse_routes=True) if sparse_routes else dict(return_assignments=True, dense=dense)
        if self.k == 1:
            out = top1gating(logits, cf, self.min_capacity, used_token,
                             self.noisy_gate_policy if self.training else None, self.drop_tokens,
                             self.use_rts, self.ep_group, **ask)
        elif self.k == 2:
            out = top2gating(logits, cf, self.min_capacity, self.drop_tokens, self.ep_group,
                             self.top2_2nd_expert_sampling and self.training, **ask)
        else:
            out = topkgating(logits, self.k, cf, self.min_capacity, self.drop_tokens, self.ep_group, **ask)
        if not sparse_routes:
            self.last_assignments, out = out[4], out[:4]
        if t0 is not None:
            self.gate_time = (time.perf_counter() - t0) * 1000.0
        return out


# ---------------------------------------------------------------- all-to-all with exact splits
class MoEAllToAllError(RuntimeError):
    """An MoE all-to-all failed (a peer died or raised): names the collective and group."""


def _all_to_all(x: torch.Tensor, out_rows: int, out_splits, in_splits, group, what: str) -> torch.Tensor:
    out = x.new_empty((out_rows,) + tuple(x.shape[1:]))
    try:
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(out_splits),
                               input_split_sizes=list(in_splits), group=group)
    except Exception as err:  # noqa: BLE001 - re-raised with the collective named
        raise MoEAllToAllError(
            f"MoE all-to-all ({what}) over the expert-parallel group failed on rank "
            f"{dist.get_rank()}: {err}. Another rank probably failed or left the step; see its error.") from err
    return out


class _AllToAllV(torch.autograd.Function):
    """all_to_all_single with split sizes; backward sends gradients the reverse way."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits, what):
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.what = group, out_splits, in_splits, what
        return _all_to_all(x, sum(out_splits), out_splits, in_splits, group, what)

    @staticmethod
    def backward(ctx, grad):
        g = _all_to_all(grad, sum(ctx.in_splits), ctx.in_splits, ctx.out_splits, ctx.group,
                        ctx.what + " backward")
        return g, None, None, None, None


class MOELayer(torch.nn.Module):
    """Gate -> dispatch (all-to-all) -> local experts -> combine (all-to-all).

    ``forward(input, used_token=None)`` -> ``output`` (input's shape); ``l_aux`` and
    ``exp_counts`` of that forward are kept as attributes, as in DeepSpeed's layer. With
    ``wall_clock_breakdown`` set, ``time_falltoall``/``time_salltoall`` (ms, first and
    second all-to-all incl. the count exchange) and ``time_moe`` (ms, whole layer) are
    recorded; ``a2a_bytes_sent`` counts the token bytes this rank sent to other ranks in
    the last forward (both directions)."""

    def __init__(self, gate: TopKGate, experts: torch.nn.Module, ep_group_name: str, ep_size: int,
                 num_local_experts: int, use_tutel: bool = False):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group = None
        self.ep_group_name = ep_group_name
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.use_tutel = False
        self.wall_clock_breakdown = False
        self.time_falltoall = self.time_salltoall = self.time_moe = 0.0
        self.a2a_bytes_sent = 0
        self.l_aux = None
        self.exp_counts = None

    def _set_ep_group(self, ep_group):
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def _run_local_experts(self, tokens: torch.Tensor, counts_per_expert) -> torch.Tensor:
        """``tokens`` grouped by local expert (``counts_per_expert`` rows each)."""
        outs = []
        for j, chunk in enumerate(torch.split(tokens, counts_per_expert, dim=0)):
            out = self.experts.deepspeed_experts[j](chunk)   # also for 0 rows: every param gets a grad
            outs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outs, dim=0)

    def forward(self, *input, **kwargs):
        x = input[0]
        used_token = input[1] if len(input) > 1 else kwargs.get("used_token")
        timing = self.wall_clock_breakdown
        t_start = time.perf_counter() if timing else None
        d_model = x.shape[-1]
        tokens = x.reshape(-1, d_model)
        sparse_gate = isinstance(self.gate, TopKGate)
        if sparse_gate:
            l_aux, combine_weights, dispatch_mask, exp_counts = self.gate._route(tokens, used_token, dense=False)
        else:
            l_aux, combine_weights, dispatch_mask, exp_counts = self.gate(tokens, used_token)
        E = self.gate.num_experts if sparse_gate else combine_weights.shape[1]
        L, ep = self.num_local_experts, self.ep_size
        # occupied slots, expert-major then slot order: (expert, slot, token, weight)
        sparse = self.gate.last_assignments if sparse_gate else None
        if sparse is not None:
            e_idx, c_idx, s_idx, weights = sparse
        else:   # a gate of another kind: read the dense tensors
            e_idx, c_idx, s_idx = dispatch_mask.permute(1, 2, 0).nonzero(as_tuple=True)
            weights = combine_weights[s_idx, e_idx, c_idx]
        weights = weights.to(x.dtype)
        counts = torch.bincount(e_idx, minlength=E)                    # per global expert, this rank's tokens
        send = tokens.index_select(0, s_idx)
        if ep == 1:
            y = self._run_local_experts(send, counts.tolist())
            self.a2a_bytes_sent = 0
        else:
            group = self.ep_group
            t0 = time.perf_counter() if timing else None
            recv_counts = torch.empty_like(counts)
            try:
                dist.all_to_all_single(recv_counts, counts, group=group)   # [ep, L]: from each source, per local expert
            except Exception as err:  # noqa: BLE001
                raise MoEAllToAllError(f"MoE all-to-all (token counts) over expert-parallel group "
                                       f"{self.ep_group_name} failed on rank {dist.get_rank()}: {err}") from err
            send_splits = counts.view(ep, L).sum(dim=1).tolist()
            rc = recv_counts.view(ep, L)
            recv_splits = rc.sum(dim=1).tolist()
            recv = _AllToAllV.apply(send, group, recv_splits, send_splits, f"dispatch, {self.ep_group_name}")
            if timing:
                self.time_falltoall = (time.perf_counter() - t0) * 1000.0
            # regroup (source, expert) -> (expert, source) so each expert's tokens are contiguous
            blocks = torch.split(recv, rc.reshape(-1).tolist(), dim=0)
            order = [s * L + j for j in range(L) for s in range(ep)]
            grouped = torch.cat([blocks[i] for i in order], dim=0) if blocks else recv
            out = self._run_local_experts(grouped, rc.sum(dim=0).tolist())
            out_blocks = torch.split(out, [int(rc[s, j]) for j in range(L) for s in range(ep)], dim=0)
            back_pos = {i: b for i, b in zip(order, out_blocks)}
            back = torch.cat([back_pos[i] for i in range(ep * L)], dim=0)
            t1 = time.perf_counter() if timing else None
            y = _AllToAllV.apply(back, group, send_splits, recv_splits, f"combine, {self.ep_group_name}")
            if timing:
                self.time_salltoall = (time.perf_counter() - t1) * 1000.0
            me = dist.get_rank(group)
            row_bytes = d_model * x.element_size()
            self.a2a_bytes_sent = row_bytes * (sum(send_splits) - send_splits[me] + sum(recv_splits) - recv_splits[me])
        combined = torch.zeros_like(tokens).index_add_(0, s_idx, y * weights.unsqueeze(1))
        out = combined.reshape(x.shape)
        self.l_aux, self.exp_counts = l_aux, exp_counts
        if timing:
            self.time_moe = (time.perf_counter() - t_start) * 1000.0
        return out

"""Pipeline p2p: after the first LAG (2) transfers of a shape a transfer is one message (header
and tensors packed), and with receives posted ahead (up to two per channel) every transfer
arrives intact and in order, also when the shapes change or a stage aborts (the message of
the old size then carries only the header; the rest follows on the channel's extras tag)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests.helpers.dist import run_distributed


def _body(rank, world):
    from deepspeed.runtime.pipe.p2p import P2P, PipelineError
    p2p = P2P(0 if rank == 1 else None, 1 if rank == 0 else None, stage_id=rank)
    chan = (0, p2p.act_tag)
    out = {}
    a = torch.arange(12.0).reshape(3, 4)
    b = torch.arange(6, dtype=torch.int64)

    # the receiver posts ahead (P2P.plan); the second transfer lands in a receive posted ahead
    if rank == 1:
        p2p.plan({chan: 4})
    dist.barrier()
    if rank == 0:
        counts = [p2p.messages_sent]
        for k in range(3):
            p2p.send_tensors([a + k], 1, is_tuple=False)
            counts.append(p2p.messages_sent)
        out["messages_per_transfer"] = [b - a_ for a_, b in zip(counts, counts[1:])]
        out["descriptions"] = p2p.descriptions_sent
    if rank == 1:
        out["first"] = p2p.recv_tensors(0)
        out["second"] = p2p.recv_tensors(0)   # posted before the first was waited for
        out["third"] = p2p.recv_tensors(0)
    if rank == 0:
        p2p.wait_sends()
    dist.barrier()
    # the shapes change: placeholders fill the receive posted with the old shape
    if rank == 0:
        p2p.send_tensors([a[:2], b], 1)
        p2p.wait_sends()
    if rank == 1:
        out["changed"] = p2p.recv_tensors(0)
    dist.barrier()
    # gradients whose shapes alternate: a lead is sized by the transfer two before, so from the
    # third transfer on each is one message again (received on demand here: nothing planned)
    g = [torch.arange(6.0).reshape(2, 3), torch.arange(4.0) * 10]
    if rank == 0:
        counts = [p2p.messages_sent]
        for k in range(4):
            p2p.send_grads([g[k % 2] + k], 1)
            counts.append(p2p.messages_sent)
        out["grad_messages"] = [b - a_ for a_, b in zip(counts, counts[1:])]
        p2p.wait_sends()
    if rank == 1:
        out["grads"] = [p2p.recv_grads([g[k % 2]], 0)[0].clone() for k in range(4)]
    dist.barrier()
    # a failing sender: the abort notice arrives whole although a receive was posted ahead
    if rank == 0:
        p2p.abort("stage 0 broke on purpose")
    if rank == 1:
        try:
            p2p.recv_tensors(0)
        except PipelineError as err:
            out["abort"] = str(err)
        out["posted_ahead"] = p2p.posted_ahead
    dist.barrier()
    return out


def test_receives_posted_ahead_stay_in_step_through_shape_changes_and_abort():
    r0, r1 = run_distributed(_body, 2, timeout=120)
    # lead + description + tensor, then lead + tensor (description unchanged), then one message
    assert r0["messages_per_transfer"] == [3, 2, 1]
    assert r0["descriptions"] == 1
    a = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(r1["first"], a) and torch.equal(r1["second"], a + 1) and torch.equal(r1["third"], a + 2)
    x, y = r1["changed"]
    assert torch.equal(x, a[:2]) and torch.equal(y, torch.arange(6)) and y.dtype == torch.int64
    assert r0["grad_messages"] == [2, 2, 1, 1]
    assert all(torch.equal(r1["grads"][k], torch.arange(6.0).reshape(2, 3) + k if k % 2 == 0 else
                           torch.arange(4.0) * 10 + k) for k in range(4))
    assert r1["abort"] == "stage 0 broke on purpose"
    assert r1["posted_ahead"] == 4   # every planned receive; the abort notice is received on demand

"""Hostfiles, resource filters and the world-info blob.

A *resource pool* is an ordered dict ``host -> [slot ids]`` (a slot is one GPU, or one
process on CPU). The hostfile gives the pool; ``--include``/``--exclude`` or
``--num_nodes``/``--num_gpus`` narrow it to the *active resources*, which travel to
every node's launcher as base64-encoded JSON (``--world_info``).

Every mistake raises :class:`ResourceError` (a ``ValueError``) whose message names the
option or the file and line, so the runner can print it and stop.
"""
from __future__ import annotations

import base64
import binascii
import json
import os
import re
from collections import OrderedDict
from typing import Dict, List, Optional

from .constants import DEFAULT_HOSTFILE

ResourcePool = "OrderedDict[str, List[int]]"

_HOST_LINE = re.compile(r"^(?P<host>\S+)\s+slots\s*=\s*(?P<slots>\S+)$")


class ResourceError(ValueError):
    """A bad hostfile, filter or resource request; the message says what to fix."""


# --------------------------------------------------------------------------- hostfile
def parse_hostfile_lines(lines, source: str = "<hostfile>") -> "OrderedDict[str, int]":
    """Parse ``hostname slots=N`` lines into ``host -> slot count`` (file order kept)."""
    hosts: "OrderedDict[str, int]" = OrderedDict()
    for lineno, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _HOST_LINE.match(line)
        if m is None:
            raise ResourceError(f"{source}:{lineno}: cannot parse {raw.strip()!r}; "
                                "each line must be 'hostname slots=N' (comments start with '#')")
        host, slots = m.group("host"), m.group("slots")
        try:
            count = int(slots)
        except ValueError:
            count = -1
        if count < 1:
            raise ResourceError(f"{source}:{lineno}: slot count {slots!r} for host {host!r} "
                                "must be a positive integer")
        if host in hosts:
            raise ResourceError(f"{source}:{lineno}: host {host!r} is listed twice; "
                                "give each host once with its total slot count")
        hosts[host] = count
    if not hosts:
        raise ResourceError(f"{source}: the hostfile lists no hosts; add lines like 'worker-1 slots=4'")
    return hosts


def parse_hostfile(path: str) -> "OrderedDict[str, int]":
    """Read a hostfile; a missing or unreadable file is an error naming the path."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as err:
        raise ResourceError(f"cannot read hostfile {path!r}: {err.strerror or err}") from None
    return parse_hostfile_lines(lines, source=path)


def fetch_hostfile(path: Optional[str]) -> "Optional[OrderedDict[str, int]]":
    """The hostfile's hosts, or ``None`` for a local-only run.

    An explicit ``path`` must exist. With ``path=None`` the default ``/job/hostfile`` is
    used when present, and its absence means "this machine only".
    """
    if path is None:
        if not os.path.isfile(DEFAULT_HOSTFILE):
            return None
        path = DEFAULT_HOSTFILE
    elif not os.path.isfile(path):
        raise ResourceError(f"--hostfile {path!r} does not exist; pass an existing file, or leave "
                            f"--hostfile out to run on this machine only")
    return parse_hostfile(path)


def pool_from_slot_counts(hosts: "Dict[str, int]") -> "OrderedDict[str, List[int]]":
    return OrderedDict((h, list(range(n))) for h, n in hosts.items())


# --------------------------------------------------------------------------- filters
def parse_resource_filter(spec: str, option: str = "--include") -> "OrderedDict[str, Optional[List[int]]]":
    """Parse ``host1:0,1@host2`` into ``{host1: [0, 1], host2: None}`` (None = every slot)."""
    if spec is None or not spec.strip():
        raise ResourceError(f"{option} is empty; use the form 'host1:0,1@host2'")
    out: "OrderedDict[str, Optional[List[int]]]" = OrderedDict()
    for part in spec.split("@"):
        part = part.strip()
        if not part:
            raise ResourceError(f"{option} {spec!r} has an empty entry between '@' separators")
        host, sep, slot_text = part.partition(":")
        host = host.strip()
        if not host:
            raise ResourceError(f"{option} {spec!r}: entry {part!r} has no host name")
        if not sep:
            out[host] = None
            continue
        slots = []
        for tok in slot_text.split(","):
            tok = tok.strip()
            if not tok.isdigit():
                raise ResourceError(f"{option} {spec!r}: slot {tok!r} for host {host!r} is not a "
                                    "non-negative integer; use e.g. 'host:0,1'")
            slots.append(int(tok))
        if host in out and out[host] is not None:
            slots = out[host] + slots
        elif host in out:  # an earlier bare entry already selected every slot
            continue
        out[host] = sorted(set(slots))
    return out


def _check_filter_against_pool(filt, pool, option: str) -> None:
    for host, slots in filt.items():
        if host not in pool:
            raise ResourceError(f"{option}: host {host!r} is not in the resource pool "
                                f"(known hosts: {', '.join(pool) or 'none'})")
        for s in slots or ():
            if s not in pool[host]:
                raise ResourceError(f"{option}: slot {s} is not available on host {host!r} "
                                    f"(available slots: {pool[host]})")


def apply_include(pool, spec: str) -> "OrderedDict[str, List[int]]":
    filt = parse_resource_filter(spec, "--include")
    _check_filter_against_pool(filt, pool, "--include")
    # Keep the pool's host order: it decides node ranks.
    return OrderedDict((h, list(pool[h]) if filt[h] is None else filt[h]) for h in pool if h in filt)


def apply_exclude(pool, spec: str) -> "OrderedDict[str, List[int]]":
    filt = parse_resource_filter(spec, "--exclude")
    _check_filter_against_pool(filt, pool, "--exclude")
    out: "OrderedDict[str, List[int]]" = OrderedDict()
    for host, slots in pool.items():
        if host in filt:
            drop = set(slots) if filt[host] is None else set(filt[host])
            slots = [s for s in slots if s not in drop]
        if slots:
            out[host] = list(slots)
    return out   # may be empty (DeepSpeed's parse_resource_filter returns {}); resolve_resources refuses that


def select_resources(pool, include: str = "", exclude: str = "", num_nodes: int = -1,
                     num_gpus: int = -1) -> "OrderedDict[str, List[int]]":
    """Narrow ``pool`` to the active resources. Contradictory requests are errors."""
    if include and exclude:
        raise ResourceError("--include and --exclude cannot be used together; list the wanted "
                            "slots with --include, or the unwanted ones with --exclude")
    if (include or exclude) and (num_nodes > 0 or num_gpus > 0):
        which = "--include" if include else "--exclude"
        raise ResourceError(f"--num_nodes/--num_gpus cannot be combined with {which}; "
                            f"name the slots in {which} instead")
    if num_nodes == 0 or num_nodes < -1:
        raise ResourceError(f"--num_nodes must be a positive integer, got {num_nodes}")
    if num_gpus == 0 or num_gpus < -1:
        raise ResourceError(f"--num_gpus must be a positive integer, got {num_gpus}")
    if include:
        return apply_include(pool, include)
    if exclude:
        return apply_exclude(pool, exclude)
    active = OrderedDict((h, list(s)) for h, s in pool.items())
    if num_nodes > 0:
        if num_nodes > len(active):
            raise ResourceError(f"--num_nodes {num_nodes} asks for more nodes than the {len(active)} "
                                f"available ({', '.join(active)})")
        active = OrderedDict(list(active.items())[:num_nodes])
    if num_gpus > 0:
        short = [f"{h} ({len(s)})" for h, s in active.items() if len(s) < num_gpus]
        if short:
            raise ResourceError(f"--num_gpus {num_gpus} is more than the slots on host(s) "
                                f"{', '.join(short)}")
        active = OrderedDict((h, s[:num_gpus]) for h, s in active.items())
    return active


# --------------------------------------------------------------------------- world info
def as_slot_lists(resources) -> "OrderedDict[str, List[int]]":
    """``{host: [slot ids]}`` from either slot-id lists or slot counts (``{host: 2}`` -> ``[0, 1]``)."""
    out: "OrderedDict[str, List[int]]" = OrderedDict()
    for h, s in resources.items():
        if isinstance(s, bool) or not isinstance(s, (int, list, tuple, range)):
            raise ResourceError(f"host {h!r}: slots must be a count or a list of slot ids, got {s!r}")
        out[h] = list(range(s)) if isinstance(s, int) else list(s)
    return out


def encode_world_info(resources) -> str:
    """``{host: [slots]}`` (or ``{host: slot count}``) as URL-safe base64 JSON, safe to put
    on any command line."""
    payload = json.dumps(as_slot_lists(resources))
    return base64.urlsafe_b64encode(payload.encode("utf-8")).decode("ascii")


def decode_world_info(blob: str) -> "OrderedDict[str, List[int]]":
    try:
        data = json.loads(base64.urlsafe_b64decode(blob.encode("ascii")).decode("utf-8"),
                          object_pairs_hook=OrderedDict)
    except (binascii.Error, ValueError, UnicodeError) as err:
        raise ResourceError(f"--world_info is not base64-encoded JSON ({err})") from None
    ok = isinstance(data, dict) and data and all(
        isinstance(s, list) and s and all(isinstance(i, int) and i >= 0 for i in s) for s in data.values())
    if not ok:
        raise ResourceError("--world_info must encode a non-empty mapping host -> list of slot ids, "
                            f"got {data!r}")
    return data


def total_slots(resources) -> int:
    return sum(len(s) for s in resources.values())

"""The optimizer-side checkpoint format shared by every ZeRO stage ("fragments").

Why: a checkpoint must load at any data-parallel world size and any ZeRO stage with
no offline conversion. So nothing in the files depends on how a rank's partition
was laid out in memory; everything is keyed by *parameter name* and by element
offsets within the flattened parameter.

Files. Each data-parallel rank ``dp`` of model-parallel rank ``mp`` writes one file,
``zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt`` (stage 0 writes only dp 0),
holding one dict, its *rank state*::

    {
      "format": "deepspeed-fragments", "version": 1,
      "zero_stage": 0..3, "dp_world_size": int, "dp_rank": int, "mp_rank": int,
      "dtype": "fp32" | "fp16" | "bf16",          # dtype the module trained in
      "params": {                                   # trainable parameters this rank owns elements of
        "<name>": {"shape": [...],                  # full (unpartitioned) shape
                   "fragments": [                   # disjoint runs of the flattened parameter
                       {"offset": int, "numel": int,
                        "fp32": Tensor[numel],      # fp32 master weights of those elements
                        "state": {"exp_avg": Tensor[numel], "exp_avg_sq": Tensor[numel], ...}},
                   ]},
      },
      "param_groups": [{"params": ["<name>", ...], "lr": ..., "betas": ..., ...}],   # every file: all groups
      "group_state": [{"step": ...}],               # per group: optimizer state that is not per element
      "optimizer_class": "AdamW" | None,
      "loss_scaler": dict | None,                   # LossScalerBase.state_dict()
      "extra": {...},                               # strategy-specific, never required to load
    }

Rules every writer follows (stage 3 included):
  * Over all files of a checkpoint, the fragments of one parameter are disjoint and
    cover ``[0, numel)`` exactly once. Padding is never written.
  * Per-element optimizer state (a tensor with as many elements as the fragment) goes
    under ``fragment["state"]``, flattened. Anything else the optimizer keeps per
    parameter (Adam's ``step``) goes once into ``group_state[i]``; a parameter whose
    scalars differ from its group's (it got no gradient in some step, so its ``step``
    is behind) carries its own under ``params[name]["scalars"]``, which readers prefer.
  * ``param_groups[i]["params"]`` lists the group's parameter names in the group's
    order; the other keys are the optimizer's hyperparameters for that group.

Readers use :class:`FragmentIndex`: it opens every rank file of a tag memory-mapped
and copies any element range of any parameter out of whichever files hold it, so a
loader only touches the bytes of its own partition and consolidation needs memory
for one tensor at a time.
"""
from __future__ import annotations

import contextlib
import os
import re
import threading
from typing import Dict, Iterable, List, Optional

import torch

from .errors import CheckpointError
from .manifest import current_share

FORMAT = "deepspeed-fragments"
VERSION = 1
_FILE_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def optim_file_name(dp_rank: int, mp_rank: int) -> str:
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype))


def split_param_state(state: dict, shape) -> tuple:
    """Split one parameter's torch optimizer state into per-element tensors (those shaped
    like the parameter, e.g. ``exp_avg``) and the rest (``step`` and other scalars)."""
    shape = torch.Size(shape)
    per_elem, scalars = {}, {}
    for k, v in state.items():
        if torch.is_tensor(v) and v.shape == shape and k != "step":
            per_elem[k] = v
        else:
            scalars[k] = v
    return per_elem, scalars


def _same_scalars(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if torch.is_tensor(x) or torch.is_tensor(y):
            if not (torch.is_tensor(x) and torch.is_tensor(y) and x.shape == y.shape and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


_SHARING = threading.local()


@contextlib.contextmanager
def share_saved_tensors():
    """Within this context (on this thread) :func:`make_rank_state` keeps contiguous CPU
    tensors by reference instead of copying them: each fragment tensor gets a storage of
    its own (so ``torch.save`` writes exactly its elements) over the caller's memory.

    For a save that writes the rank state straight away from memory-mapped tensors
    (``offload_optimizer.device: nvme``): a copy would put the rank's whole optimizer state
    in anonymous memory. The tensors must not change until the file is written, and the
    rank state must not be kept."""
    before = getattr(_SHARING, "on", False)
    _SHARING.on = True
    try:
        yield
    finally:
        _SHARING.on = before


def _alias_exact(t: torch.Tensor) -> Optional[torch.Tensor]:
    """``t`` (flat, CPU, contiguous) as a tensor whose storage is exactly its elements,
    sharing its memory; None where that is not possible (another device, a dtype numpy
    lacks)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.requires_grad:
        return None
    if t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    try:
        return torch.from_numpy(t.numpy())   # the array holds t (and its storage) alive
    except (TypeError, RuntimeError):
        return None


def make_rank_state(*, zero_stage: int, dp_world_size: int, dp_rank: int, mp_rank: int, dtype,
                    params: Dict[str, dict], param_groups: List[dict], group_state: List[dict],
                    optimizer_class: Optional[str], loss_scaler: Optional[dict], extra: Optional[dict] = None) -> dict:
    """Assemble a rank state (see the module docstring); tensors are made contiguous
    CPU clones so a save never drags whole flat buffers into the file (under
    :func:`share_saved_tensors`: exact-size aliases instead of clones)."""
    share = getattr(_SHARING, "on", False)

    def _cpu(t):
        t = t.detach().reshape(-1)
        if share:
            alias = _alias_exact(t)
            if alias is not None:
                return alias
        return t.to("cpu", copy=True).contiguous()

    out_params = {}
    for name, entry in params.items():
        frags = []
        for f in entry["fragments"]:
            frags.append({"offset": int(f["offset"]), "numel": int(f["numel"]), "fp32": _cpu(f["fp32"]).float(),
                          "state": {k: _cpu(v) for k, v in f.get("state", {}).items()}})
        out_params[name] = {"shape": [int(s) for s in entry["shape"]], "fragments": frags}
        if entry.get("scalars"):
            out_params[name]["scalars"] = {k: _plain(v) for k, v in entry["scalars"].items()}
    return {"format": FORMAT, "version": VERSION, "zero_stage": int(zero_stage),
            "dp_world_size": int(dp_world_size), "dp_rank": int(dp_rank), "mp_rank": int(mp_rank),
            "dtype": dtype if isinstance(dtype, str) else dtype_name(dtype), "params": out_params,
            "param_groups": [_plain_group(g) for g in param_groups],
            "group_state": [{k: _plain(v) for k, v in gs.items()} for gs in group_state],
            "optimizer_class": optimizer_class, "loss_scaler": loss_scaler, "extra": dict(extra or {})}


def _plain(v):
    if torch.is_tensor(v):
        return v.detach().to("cpu", copy=True)
    if isinstance(v, (list, tuple)):
        return type(v)(_plain(x) for x in v)
    return v


def _plain_group(g: dict) -> dict:
    out = {k: _plain(v) for k, v in g.items() if k != "params"}
    out["params"] = list(g["params"])
    return out


def list_rank_files(directory: str, mp_rank: int = 0) -> List[str]:
    """The optimizer files of one model-parallel rank, ordered by dp rank."""
    found = []
    for n in os.listdir(directory):
        m = _FILE_RE.match(n)
        if m and int(m.group(2)) == mp_rank:
            found.append((int(m.group(1)), n))
    _check_listed(directory, mp_rank)
    return [os.path.join(directory, n) for _, n in sorted(found)]


def _check_listed(directory: str, mp_rank: int) -> None:
    """Raise naming the rank and world size if an optimizer file the tag's manifest lists is missing."""
    from .manifest import check_complete, read_manifest
    man = read_manifest(directory)
    if man:
        names = [n for n in man["files"] if _FILE_RE.match(n) and int(_FILE_RE.match(n).group(2)) == mp_rank]
        check_complete(directory, names)


def _load(path: str, check: bool = True):
    """One rank file, memory-mapped, through the package's one verified weights-only reader
    (``check=False``: another rank checks it and the load's agreement covers this one)."""
    from .io import load_file
    return unwrap_rank_state(load_file(path, mmap=True, verify=None if check else False))


def _load_mapped_noreserve(path: str):
    """The MAP_NORESERVE fallback of :func:`_load` (lives in :mod:`.io`, with the one allow-list)."""
    from .io import _load_mapped_noreserve as load
    return load(path)


def unwrap_rank_state(obj):
    """The rank state of an optimizer file: inside DeepSpeed's envelope
    (``obj["optimizer_state_dict"]``, see :mod:`.contents`) since 0.19, the whole file before."""
    inner = obj.get("optimizer_state_dict") if isinstance(obj, dict) else None
    return inner if isinstance(inner, dict) and inner.get("format") == FORMAT else obj


# Readers of tag directories written in another layout, each ``reader(directory, mp_rank)``
# returning that directory's optimizer state as rank states in this format, or ``None`` when
# the directory is not in its layout. DeepSpeed's own layout (:mod:`.deepspeed_native`)
# registers itself when ``deepspeed.runtime.checkpoint`` is imported, so this index reads
# DeepSpeed's checkpoints without this file depending on the converter.
_FOREIGN_READERS: List = []


def register_rank_state_reader(reader) -> None:
    """Add a reader of another checkpoint layout (see ``_FOREIGN_READERS``); once only."""
    if reader not in _FOREIGN_READERS:
        _FOREIGN_READERS.append(reader)


def _foreign_rank_states(directory: str, mp_rank: int) -> Optional[List[dict]]:
    for reader in _FOREIGN_READERS:
        states = reader(directory, mp_rank)
        if states is not None:
            return states
    return None


class FragmentIndex:
    """All rank files of one checkpoint tag, indexed by parameter name.

    ``read(name, key, start, numel)`` copies an element range of the flattened
    parameter (``key`` is ``"fp32"`` or an optimizer state name such as ``"exp_avg"``)
    out of the fragments that hold it; missing elements are an error.
    """

    def __init__(self, directory: str, mp_rank: int = 0, states: Optional[List[dict]] = None,
                 complete: bool = True):
        """``complete=False`` (one rank's own ``state_dict()`` loaded back at the same world
        size, as DeepSpeed's ZeRO optimizers allow): fragments need not cover every
        parameter; reading a range no fragment holds is still an error."""
        self.directory = directory
        self.complete = complete
        if states is None:   # another layout (DeepSpeed's own files): its registered reader converts it
            states = _foreign_rank_states(directory, mp_rank)
        if states is None:
            paths = list_rank_files(directory, mp_rank)
            if not paths:
                raise CheckpointError(
                    f"No ZeRO optimizer files 'zero_pp_rank_*_mp_rank_{mp_rank:02d}_optim_states.pt' in "
                    f"'{directory}'. Was this checkpoint saved by deepspeed.save_checkpoint? Pass "
                    f"load_optimizer_states=False to load the module weights only.")
            share = current_share()   # every rank reads these files: each checks its share
            states = [_load(p, check=share is None or i % share[1] == share[0]) for i, p in enumerate(paths)]
        else:
            paths = [f"{directory}[{i}]" for i in range(len(states))]
        self.states = states
        for p, st in zip(paths, self.states):
            if not isinstance(st, dict) or st.get("format") != FORMAT:
                raise CheckpointError(
                    f"'{p}' is not in the '{FORMAT}' format (found format "
                    f"{st.get('format') if isinstance(st, dict) else type(st).__name__!r}).")
        first = self.states[0]
        self.zero_stage = first["zero_stage"]
        self.dp_world_size = first["dp_world_size"]
        self.dtype = first.get("dtype", "fp32")
        self.param_groups = first["param_groups"]
        self.group_state = first["group_state"]
        self.optimizer_class = first.get("optimizer_class")
        self.loss_scaler = first.get("loss_scaler")
        expected = 1 if self.zero_stage == 0 else self.dp_world_size
        if complete and len(self.states) != expected:
            raise CheckpointError(
                f"Checkpoint '{directory}' was saved by {self.dp_world_size} data-parallel ranks at ZeRO "
                f"stage {self.zero_stage} and should hold {expected} optimizer files for mp rank "
                f"{mp_rank:02d}, but {len(self.states)} were found; the checkpoint is incomplete.")
        self._frags: Dict[str, list] = {}
        self._shapes: Dict[str, list] = {}
        self._scalars: Dict[str, dict] = {}
        for st in self.states:
            for name, entry in st["params"].items():
                self._shapes[name] = entry["shape"]
                if entry.get("scalars"):
                    self._scalars[name] = entry["scalars"]
                self._frags.setdefault(name, []).extend(entry["fragments"])
        for name, frags in self._frags.items():
            frags.sort(key=lambda f: f["offset"])
            numel = self.numel(name)
            pos = 0
            for f in frags:
                if f["offset"] != pos:
                    break
                pos += f["numel"]
            if complete and pos != numel:
                raise CheckpointError(
                    f"Checkpoint '{directory}': the fragments of parameter '{name}' cover {pos} of its "
                    f"{numel} elements contiguously; some rank file is missing or corrupt.")

    # -- queries -----------------------------------------------------------------------
    @property
    def names(self) -> List[str]:
        return list(self._frags)

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self._shapes[name])

    def numel(self, name: str) -> int:
        n = 1
        for s in self._shapes[name]:
            n *= int(s)
        return n

    def param_scalars(self, name: str) -> Optional[dict]:
        """This parameter's own non-element optimizer state (``step``) where it differs from
        its group's; None where the group's applies."""
        return self._scalars.get(name)

    def state_keys(self, name: str) -> List[str]:
        return list(self._frags[name][0]["state"].keys())

    def has(self, name: str) -> bool:
        return name in self._frags

    def require(self, names: Iterable[str]) -> None:
        missing = [n for n in names if n not in self._frags]
        if missing:
            raise CheckpointError(
                f"Checkpoint '{self.directory}' has no optimizer state for trainable parameters "
                f"{missing[:8]}{' ...' if len(missing) > 8 else ''} (it holds {len(self._frags)} parameters). "
                f"Was it saved from a different model? Pass load_optimizer_states=False to load the "
                f"module weights only.")

    # -- data ----------------------------------------------------------------------------
    def read(self, name: str, key: str = "fp32", start: int = 0, numel: Optional[int] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of the flattened ``key`` of ``name``."""
        pieces, numel = self._pieces(name, key, start, numel)
        if out is None:
            sample = self._tensor(name, self._frags[name][0], key)
            out = torch.empty(numel, dtype=sample.dtype)
        for lo, hi, f, src in pieces:
            out[lo - start:hi - start].copy_(src[lo - f["offset"]:hi - f["offset"]])
        return out

    def check(self, name: str, key: str = "fp32", start: int = 0, numel: Optional[int] = None) -> None:
        """Raise what :meth:`read` would raise for this range, copying nothing (lets a loader
        validate everything before it overwrites anything)."""
        self._pieces(name, key, start, numel)

    def _pieces(self, name, key, start, numel):
        if name not in self._frags:
            self.require([name])
        total = self.numel(name)
        numel = total - start if numel is None else numel
        end = start + numel
        if start < 0 or end > total:
            raise CheckpointError(f"Range [{start}, {end}) is outside parameter '{name}' ({total} elements).")
        pieces, covered = [], 0
        for f in self._frags[name]:
            lo, hi = max(start, f["offset"]), min(end, f["offset"] + f["numel"])
            if lo >= hi:
                continue
            pieces.append((lo, hi, f, self._tensor(name, f, key)))
            covered += hi - lo
        if covered != numel:
            raise CheckpointError(f"'{self.directory}' holds {covered} of the {numel} elements [{start}, {end}) of "
                                  f"'{name}' that were asked for (a rank's own state_dict() loads only into the "
                                  f"same rank at the same world size; pass every rank's states).")
        return pieces, numel

    def full(self, name: str, key: str = "fp32") -> torch.Tensor:
        """The whole ``key`` tensor of ``name`` in its original shape."""
        return self.read(name, key).view(self.shape(name))

    def _tensor(self, name, frag, key):
        if key == "fp32":
            return frag["fp32"]
        if key not in frag["state"]:
            raise CheckpointError(
                f"Checkpoint '{self.directory}' has no optimizer state '{key}' for '{name}' "
                f"(it has {sorted(frag['state'])}); was it saved with a different optimizer?")
        return frag["state"][key]

    # -- optimizer hyperparameters --------------------------------------------------------
    def group_of(self) -> Dict[str, int]:
        """Parameter name -> index of its saved param group."""
        return {n: i for i, g in enumerate(self.param_groups) for n in g["params"]}


# implementation switches of torch optimizers, not hyperparameters: the live optimizer keeps its own
_IMPL_KEYS = {"params", "foreach", "fused", "capturable", "differentiable"}


def apply_group_hyperparameters(saved_groups: List[dict], param_groups: List[dict], where: str) -> None:
    """Copy the saved hyperparameters (lr, betas, ...) into live ``param_groups``: the keys the
    live optimizer knows, so a checkpoint from another optimizer class or kernel choice loads."""
    if len(saved_groups) != len(param_groups):
        raise CheckpointError(
            f"{where}: the checkpoint has {len(saved_groups)} optimizer parameter groups but this "
            f"optimizer has {len(param_groups)}. Build the optimizer with the same parameter groups, "
            f"or pass load_optimizer_states=False.")
    for saved, live in zip(saved_groups, param_groups):
        for k, v in saved.items():
            if k in live and k not in _IMPL_KEYS:
                live[k] = v


def load_state_keeping_groups(optimizer, state_dict: dict) -> None:
    """``optimizer.load_state_dict(state_dict)``, keeping the existing param-group dicts
    (and the list holding them): torch's ``load_state_dict`` installs new dicts, which would
    orphan a client LR scheduler or wrapper holding the old ones. The loaded values are
    written into the old dicts instead."""
    old_list = optimizer.param_groups
    old = list(old_list)
    optimizer.load_state_dict(state_dict)
    new = optimizer.param_groups
    if new is old_list and all(a is b for a, b in zip(new, old)):
        return
    if len(new) != len(old):
        raise CheckpointError(f"loading optimizer state changed the number of parameter groups "
                              f"({len(old)} -> {len(new)}).")
    for o, n in zip(old, new):
        if o is not n:
            o.clear()
            o.update(n)
    old_list[:] = old
    optimizer.param_groups = old_list


def load_torch_optimizer(optimizer, states: Dict[int, dict], saved_groups: List[dict], where: str) -> None:
    """Load per-tensor state (``states``: id(tensor) -> {key: value}) and the saved group
    hyperparameters into a torch-style optimizer through its own ``load_state_dict``,
    which applies the optimizer's device/dtype rules (e.g. where Adam keeps ``step``)."""
    sd = optimizer.state_dict()
    live = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    sd["state"] = {i: states[id(p)] for i, p in zip(ids, live) if id(p) in states}
    apply_group_hyperparameters(saved_groups, sd["param_groups"], where)
    load_state_keeping_groups(optimizer, sd)


def rank_state_from_torch_optimizer(module, optimizer, *, zero_stage: int, dp_world_size: int, mp_rank: int,
                                    loss_scaler: Optional[dict] = None) -> dict:
    """The rank state of an unpartitioned optimizer that updates the module's own
    parameters (stage 0 in fp32): every parameter is one whole fragment."""
    names = {}
    for n, p in module.named_parameters():
        names.setdefault(id(p), n)
    params, groups, group_state = {}, [], []
    for gi, g in enumerate(optimizer.param_groups):
        gnames, scalars = [], {}
        for p in g["params"]:
            if id(p) not in names:
                raise CheckpointError(f"optimizer param group {gi} holds a parameter that is not in the model.")
            name = names[id(p)]
            gnames.append(name)
            per_elem, sc = split_param_state(optimizer.state.get(p, {}), p.shape)
            scalars = scalars or sc
            params[name] = {"shape": list(p.shape), "fragments": [
                {"offset": 0, "numel": p.numel(), "fp32": p.detach(), "state": per_elem}]}
            if sc and not _same_scalars(sc, scalars):   # e.g. a step count behind its group's
                params[name]["scalars"] = {k: _plain(v) for k, v in sc.items()}
        groups.append(dict({k: v for k, v in g.items() if k != "params"}, params=gnames))
        group_state.append(scalars)
    any_p = next(iter(module.parameters()), None)
    return make_rank_state(zero_stage=zero_stage, dp_world_size=dp_world_size, dp_rank=0, mp_rank=mp_rank,
                           dtype=any_p.dtype if any_p is not None else torch.float32, params=params,
                           param_groups=groups, group_state=group_state,
                           optimizer_class=type(optimizer).__name__, loss_scaler=loss_scaler,
                           extra={"frozen_params": [n for n, p in module.named_parameters() if not p.requires_grad]})


def load_torch_optimizer_from_index(module, optimizer, idx: FragmentIndex, where: str) -> None:
    """Restore an unpartitioned optimizer over the module's parameters (stage 0) from a
    checkpoint of any stage and world size; the module's trainable parameters get the
    exact fp32 master values."""
    names = {}
    for n, p in module.named_parameters():
        names.setdefault(id(p), n)
    live = [p for g in optimizer.param_groups for p in g["params"]]
    idx.require([names[id(p)] for p in live if id(p) in names])
    group_of = idx.group_of()
    states = {}
    for p in live:
        name = names[id(p)]
        with torch.no_grad():
            p.copy_(idx.full(name, "fp32"))
        st = {k: idx.full(name, k) for k in idx.state_keys(name)}
        if st:
            scalars = idx.param_scalars(name)
            if scalars is None:
                scalars = idx.group_state[group_of.get(name, 0)]
            st.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars.items()})
            states[id(p)] = st
    load_torch_optimizer(optimizer, states, idx.param_groups, where)

"""Where optional training techniques plug into the engine.

Curriculum learning, the data-efficiency library (curriculum data sampling, random-LTD),
progressive layer drop and the eigenvalue estimator each live in their own package and
need the engine at a handful of moments: before the forward (extra keyword arguments
such as ``curriculum_seqlen`` or ``pld_theta``), before the backward (the eigenvalue
estimator reads the loss's graph), at the accumulation boundary before the optimizer
step (schedules advance), when the training data loader is built (a batch sampler),
and when a checkpoint is written or read (their state).

The runtime does not import those packages. Each registers a factory here with
:func:`register_feature`; ``DeepSpeedEngine.__init__`` calls :func:`build_features`
once, which asks every registered factory for an :class:`EngineFeature` (``None`` when
its config section is off), and the engine then calls the few :class:`FeatureSet`
methods below. With no feature on, the set is empty and each call is one truth test.

Registration happens when ``deepspeed`` is imported (its ``__init__`` imports the
feature packages), so a feature is available to every engine without the runtime
naming it.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

#: Factories in registration order: ``factory(engine) -> EngineFeature | None``.
_FACTORIES: Dict[str, Callable] = {}


#: The model-states keys the registered features write (so checkpoint code can tell them
#: from client state).
_CHECKPOINT_KEYS: set = set()


def register_feature(name: str, factory: Callable, checkpoint_key: Optional[str] = None) -> None:
    """Register ``factory(engine)``; it returns an :class:`EngineFeature` or ``None`` (off).
    ``checkpoint_key``: the model-states key its features write, if any."""
    _FACTORIES[name] = factory
    if checkpoint_key:
        _CHECKPOINT_KEYS.add(checkpoint_key)


def feature_checkpoint_keys() -> frozenset:
    """Every model-states key a registered feature may write (``data_sampler``, ``random_ltd``, ...)."""
    return frozenset(_CHECKPOINT_KEYS)


def registered_features() -> List[str]:
    return list(_FACTORIES)


class EngineFeature:
    """One technique's hooks; every hook is a no-op unless overridden.

    ``checkpoint_key``: the top-level key of the model-states file that holds
    :meth:`state_dict` (``None``: nothing to save).
    """

    name = ""
    checkpoint_key: Optional[str] = None

    def forward_kwargs(self, engine, kwargs: dict) -> None:
        """Add keyword arguments to a training-mode forward (mutate ``kwargs``)."""

    def before_backward(self, engine, loss) -> None:
        """Called with the micro-batch loss before the backward consumes its graph."""

    def on_boundary(self, engine) -> None:
        """At the accumulation boundary, before the optimizer step; ``engine.global_steps``
        still counts the completed steps (DeepSpeed's order)."""

    def after_step(self, engine) -> None:
        """At the accumulation boundary, after the optimizer step (applied or skipped) and
        the counters' update: ``engine.global_steps`` includes this step,
        ``engine.skipped_steps`` says whether it was skipped (compression steps its
        scheduler here, as DeepSpeed does after each applied step)."""

    def batch_sampler(self, engine, dataset):
        """A batch sampler for the training data loader, or ``None``."""
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class FeatureSet:
    """The engine's features, called in registration order."""

    def __init__(self, features: List[EngineFeature]):
        self.features = list(features)
        self.by_name = {f.name: f for f in self.features}

    def __bool__(self) -> bool:
        return bool(self.features)

    def get(self, name: str) -> Optional[EngineFeature]:
        return self.by_name.get(name)

    def forward_kwargs(self, engine, kwargs: dict) -> None:
        for f in self.features:
            f.forward_kwargs(engine, kwargs)

    def before_backward(self, engine, loss) -> None:
        for f in self.features:
            f.before_backward(engine, loss)

    def on_boundary(self, engine) -> None:
        for f in self.features:
            f.on_boundary(engine)

    def after_step(self, engine) -> None:
        for f in self.features:
            f.after_step(engine)

    def batch_sampler(self, engine, dataset):
        samplers = [s for s in (f.batch_sampler(engine, dataset) for f in self.features) if s is not None]
        if len(samplers) > 1:
            raise ValueError("More than one feature wants to sample the training data; enable only one of them.")
        return samplers[0] if samplers else None

    def checkpoint_state(self) -> dict:
        out = {f.checkpoint_key: f.state_dict() for f in self.features if f.checkpoint_key}
        return {k: v for k, v in out.items() if v is not None}  # None: nothing to save this time

    def load_checkpoint_state(self, state: dict) -> None:
        for f in self.features:
            if f.checkpoint_key and state.get(f.checkpoint_key) is not None:
                f.load_state_dict(state[f.checkpoint_key])


def build_features(engine) -> FeatureSet:
    """Ask every registered factory; errors in a section surface here, before training starts."""
    features = []
    for factory in _FACTORIES.values():
        feature = factory(engine)
        if feature is not None:
            features.append(feature)
    return FeatureSet(features)


def checkpoint_state(engine) -> dict:
    """The features' entries for the model-states file (empty without features)."""
    fs = getattr(engine, "_features", None)
    return fs.checkpoint_state() if fs else {}


def load_checkpoint_state(engine, state: dict) -> None:
    fs = getattr(engine, "_features", None)
    if fs:
        fs.load_checkpoint_state(state)


def _feature(engine, name: str) -> Optional[EngineFeature]:
    fs = getattr(engine, "_features", None)
    return fs.get(name) if fs else None


class EngineFeatureMethods:
    """The engine's documented methods that belong to these techniques (mixed into
    ``DeepSpeedEngine``); each forwards to its feature, found by name."""

    def get_pld_theta(self):
        """The current keep probability of progressive layer drop (``None`` when off)."""
        f = _feature(self, "progressive_layer_drop")
        return f.pld.get_theta() if f is not None else None

    def set_custom_curriculum_learning_schedule(self, schedule_func):
        """``custom`` curriculum schedules: a callable ``fn(global_step) -> difficulty`` for the
        legacy ``curriculum_learning`` section, or a dict ``{metric_name: fn}`` for the
        data-efficiency sampler (DeepSpeed's form)."""
        done = False
        for name in ("curriculum_learning_legacy", "data_sampling"):
            f = _feature(self, name)
            if f is not None:
                done = f.set_custom_schedule(schedule_func) or done
        if not done:
            raise ValueError("set_custom_curriculum_learning_schedule: no curriculum with schedule_type 'custom' "
                             "is enabled (config 'curriculum_learning' or "
                             "'data_efficiency.data_sampling.curriculum_learning').")

    def set_data_post_process_func(self, post_process_func):
        """``post_process_func(batch, sampler_state_dict) -> batch`` applied to each training batch."""
        loader = getattr(self, "training_dataloader", None)
        if loader is not None:
            loader.post_process_func = post_process_func

    def random_ltd_initialize(self):
        """Hand the random-LTD schedule to the converted layers (``convert_to_random_ltd`` calls this)."""
        f = _feature(self, "random_ltd")
        if f is None:
            raise ValueError("random_ltd_initialize: 'data_efficiency.data_routing.random_ltd' is not enabled.")
        f.initialize_layers(self)

    # ---- config queries (DeepSpeed's engine methods) ----
    def _section_on(self, key: str) -> bool:
        s = getattr(self.config_obj.model, key, None)
        return bool(s is not None and s.enabled)

    def pld_enabled(self) -> bool:
        return self._section_on("progressive_layer_drop")

    def pld_params(self):
        s = self.config_obj.model.progressive_layer_drop
        return {"theta": s.theta, "gamma": s.gamma} if s is not None else False

    def eigenvalue_enabled(self) -> bool:
        return self._section_on("eigenvalue")

    def curriculum_enabled_legacy(self) -> bool:
        return self._section_on("curriculum_learning")

    def curriculum_params_legacy(self):
        s = self.config_obj.model.curriculum_learning
        return s.to_dict() if s is not None else False

    def data_efficiency_enabled(self) -> bool:
        return self._section_on("data_efficiency")

    def curriculum_learning_enabled(self) -> bool:
        """Curriculum learning by data sampling (``data_efficiency.data_sampling.curriculum_learning``)."""
        s = self.config_obj.model.data_efficiency
        return bool(s is not None and s.enabled and s.data_sampling.curriculum_learning.enabled)

    def random_ltd_enabled(self) -> bool:
        s = self.config_obj.model.data_efficiency
        return bool(s is not None and s.enabled and s.data_routing.random_ltd.enabled)

#!/usr/bin/env python
"""Run DeepSpeed's own unit tests (its repository's ``tests/unit``) against OUR ``deepspeed``.

    make upstream-tests                                   # default module set, default source
    python tests/upstream/run_upstream.py --ds-repo ~/src/DeepSpeed --modules checkpoint launcher
    python tests/upstream/run_upstream.py --all --json /tmp/all.json

Where the tests come from (first that applies): ``--ds-repo PATH``, ``$DS_UPSTREAM_REPO``, else
the bare mirror at ``/work/.mirror/deepspeedai+DeepSpeed/repo`` (``git archive HEAD tests``).
PATH may be a work tree (a directory holding ``tests/unit``) or a bare git repository. Only its
``tests/`` directory is copied to a scratch directory: upstream's ``tests/conftest.py`` puts the
repository root on ``sys.path``, and a ``deepspeed/`` beside it would shadow ours.

How they run: on CPU (``DS_ACCELERATOR=cpu``, gloo), one module per ``pytest`` subprocess, with a
per-test timeout (pytest-timeout, thread method: a stuck test ends its process) and a per-module
budget. A small plugin (``upstream_plugin.py``) logs each test's start and outcome to a file, so
when a subprocess dies or is killed the test that was running is recorded as *hung* and the
module resumes after it with what already ran deselected. A file that does not collect is an
*error* for that module and the driver goes on to the next. Harness adaptations only, nothing
that changes the package under test:

* ``LOCAL_SIZE`` = the largest world size we run (2): DeepSpeed's CPU accelerator counts devices
  from it (else from NUMA nodes, usually 1) and upstream's ``DistributedTest`` skips a world size
  larger than the device count. World sizes above it skip, as they do upstream on a smaller host.
* ``DS_UNITTEST_TIMEOUT``: the harness's own worker timeout, set under the per-test timeout.
* the staged ``unit/common.py`` re-raises a pytest outcome from a rank (``pytest.fail``, "DID NOT
  RAISE") as an ``AssertionError`` with its message: a ``BaseException`` kills the pool's worker
  and the test would hang until the harness timeout instead of failing.
* ``upstream_plugin.py`` registers upstream's ``DistributedFixture`` subclasses as fixtures: they rely on a
  ``_pytestfixturefunction`` attribute that pytest 8.4+ ignores (DeepSpeed pins pytest < 8.4).
* ``PATH`` starts with this interpreter's directory, so the tests that run the ``deepspeed``
  command find the one installed with the package under test.

Outcome per test: passed, failed, error (setup/teardown), hung, skipped. Each failure is also
classified against ``KNOWN`` below (out of scope: needs CUDA or a compiled op, or belongs to a
feature with its own open issue; deviation: pins an internal or a limitation we deliberately do
not copy, recorded in docs/api_surface.md "DeepSpeed unit tests"). Prints a table per module and a
total, and writes a JSON summary (``--json``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OUR_REPO = os.path.dirname(os.path.dirname(HERE))
OUR_PACKAGE = os.path.join(OUR_REPO, "deepspeed")   # --package-root changes it (e.g. an older worktree)
DEFAULT_MIRROR = "/work/.mirror/deepspeedai+DeepSpeed/repo"

# The modules the default run covers (paths under tests/unit): the ones that exercise what this
# package builds and that run on CPU. `--all` runs every test file except OUT_OF_SCOPE.
DEFAULT_MODULES = [
    # ZeRO
    "runtime/zero/test_ignore_unused_parameters.py", "runtime/zero/test_nvme_checkpointing.py",
    "runtime/zero/test_unwrap_model.py", "runtime/zero/test_zero_allreduce_fetch_params.py",
    "runtime/zero/test_zero_autocast_mixed_dtype.py", "runtime/zero/test_zero_config.py",
    "runtime/zero/test_zero_context.py", "runtime/zero/test_zero_context_ancestry.py",
    "runtime/zero/test_zero_context_return.py", "runtime/zero/test_zero_dynamic_class.py",
    "runtime/zero/test_zero_grad_clip.py", "runtime/zero/test_zero_hook_attribute_delegation.py",
    "runtime/zero/test_zero_late_module_attach.py", "runtime/zero/test_zero_leaf_module.py",
    "runtime/zero/test_zero_linear_direct_init.py", "runtime/zero/test_zero_nesting_init.py",
    "runtime/zero/test_zero_offloadpp.py", "runtime/zero/test_zero_tensor_fragment.py",
    "runtime/zero/test_zero_tiled.py",
    # test_zero.py class by class: each class gets its own module budget
    "v1/zero/test_zero.py::TestGradientAllreduceOp", "v1/zero/test_zero.py::TestGradientAllreduceOpTraining",
    "v1/zero/test_zero.py::TestBF16OptimizerGradReduction", "v1/zero/test_zero.py::TestZeroUnbalancedGradients",
    "v1/zero/test_zero.py::TestZero3RepeatForwardLoop", "v1/zero/test_zero.py::TestZeroToFP32",
    "v1/zero/test_zero.py::TestIncorectAllgatherBucketSize", "v1/zero/test_zero.py::TestPartitionNcclAlignment",
    "v1/zero/test_zero.py::TestZero3ParamPartitioningBase",
    "v1/zero/test_zero.py::TestZero3ParamPartitioningLargeParam",
    "v1/zero/test_zero.py::TestZero3ParamPartitioningManyParams",
    "v1/zero/test_zero.py::TestZero3InitForParentWeightInitialization",
    "v1/zero/test_zero.py::TestZero3ParamPartitioningBaseBF16",
    "v1/zero/test_zero.py::TestParamPartitioningSkipInit", "v1/zero/test_zero.py::TestZeroOffloadStage1",
    "v1/zero/test_zero.py::TestZero3DictFwd", "v1/zero/test_zero.py::TestZeroAdamOptimizerStepCount",
    "v1/zero/test_zero.py::TestZeroFrozenWeights", "v1/zero/test_zero.py::TestZeroOffloadOptim",
    "v1/zero/test_zero.py::TestZeroPartitionCache", "v1/zero/test_zero.py::TestEmptyParameterGroup",
    "v1/zero/test_zero.py::TestZero3SwitchModes", "v1/zero/test_zero.py::TestZero3ClientModuleID",
    "v1/zero/test_offload_states.py", "v1/zero/test_overlap_comm_record_stream.py",
    "v1/zero/test_stage2_flatten_on_gpu.py", "v1/zero/test_zero2_offload_multi_backward.py",
    "v1/zero/test_zero_activation_checkpoint_lifecycle.py", "v1/zero/test_zero_autocast.py",
    "v1/zero/test_zero_coalesce_grad_reduction.py", "v1/zero/test_zero_cpu_offload_grad_accum.py",
    "v1/zero/test_zero_functorch_linear.py", "v1/zero/test_zero_hook_count_regression.py",
    "v1/zero/test_zero_init_pg_contradiction.py", "v1/zero/test_zero_torch_func.py",
    "v1/zero/test_zero_user_backward.py",
    # checkpoints
    "checkpoint/test_convert_checkpoint.py", "checkpoint/test_latest_checkpoint.py",
    "checkpoint/test_lr_scheduler.py", "checkpoint/test_moe_checkpoint.py", "checkpoint/test_other_optimizer.py",
    "checkpoint/test_pipeline.py", "checkpoint/test_reshape_checkpoint.py", "checkpoint/test_shared_weights.py",
    "checkpoint/test_sparse.py", "checkpoint/test_tag_validation.py", "checkpoint/test_universal_checkpoint.py",
    "checkpoint/test_zero_optimizer.py",
    # pipeline
    "runtime/pipe/test_pipe_schedule.py", "runtime/pipe/test_topology.py", "runtime/pipe/test_pipe.py",
    "pipe/test_pipe_module.py",
    # launcher
    "launcher/test_ds_arguments.py", "launcher/test_multinode_runner.py", "launcher/test_run.py",
    "launcher/test_user_args.py",
    # config, engine, precision, schedules
    "runtime/test_ds_config_dict.py", "runtime/test_ds_config_model.py", "runtime/test_ds_initialize.py",
    "runtime/test_lr_schedulers.py", "runtime/test_runtime_utils.py", "runtime/test_no_sync_ctxt.py",
    "runtime/test_data.py", "runtime/test_multi_output_model.py", "runtime/test_multiple_models.py",
    "runtime/test_autocast.py", "runtime/test_precision_config_dynamic_scale.py",
    "runtime/test_precision_config_loss_scale.py", "runtime/test_pld.py",
    "runtime/half_precision/test_dynamic_loss_scale.py", "runtime/half_precision/test_fp16.py",
    "runtime/half_precision/test_zero_optim_overflow.py",
    "v1/half_precision/test_bf16.py", "v1/half_precision/test_gradient_clipping_default.py",
    "v1/half_precision/test_mixed_precision_dtype.py", "v1/half_precision/test_with_autocast.py",
    "v1/test_engine_log_level.py",
    "runtime/activation_checkpointing/test_activation_checkpointing.py",
    "runtime/activation_checkpointing/test_activation_checkpointing_non_reentrant.py",
    "runtime/activation_checkpointing/test_offload_activations.py",
    "runtime/comm/test_coalesced_collectives.py", "runtime/sparse_tensor/test_averaging_sparse_gradients.py",
    "runtime/sparse_tensor/test_csr.py", "runtime/sparse_tensor/test_sparse_grads.py",
    "runtime/utils/test_partition.py",
    # MoE
    "v1/moe/test_moe.py", "v1/moe/test_moe_tp.py",
    # utils, comm, monitor, profiler, accelerator, CPU ops
    "utils/test_byte_cast.py", "utils/test_get_optim_files.py", "utils/test_groups.py",
    "utils/test_init_on_device.py", "utils/test_nvtx.py", "utils/test_partition_balanced.py",
    "utils/test_pin_memory_tracker.py",
    "comm/test_dist.py", "comm/test_comms_logger.py", "monitor/test_monitor.py",
    "profiling/flops_profiler/test_flops_profiler.py",
    "v1/accelerator/test_accelerator.py", "v1/pin_memory/test_pin_memory.py",
    "v1/pin_memory/test_destroy_unpin.py",
    "ops/adam/test_cpu_adam.py", "ops/adam/test_adamw.py", "ops/adam/test_hybrid_adam.py",
    "ops/adagrad/test_cpu_adagrad.py", "ops/lion/test_cpu_lion.py", "ops/lion/test_lion.py",
    "ops/test_op_builder.py",
    # features built since the first pass (autotuning, elasticity, compression, data efficiency, 1-bit,
    # Ulysses sequence parallelism / ALST)
    "autotuning/test_autotuning.py", "elasticity/test_elastic.py", "compression/test_compression.py",
    "runtime/test_data_efficiency.py", "runtime/half_precision/onebit/test_onebit.py",
    "sequence_parallelism/test_ulysses.py", "sequence/test_apply_rotary_pos_emb.py",
    "ulysses_alst/test_ulysses_sp_hf.py", "ulysses_alst/test_tiled_compute.py",
]

# Whole modules or directories outside this run: path prefix -> why. (Built features leave this table:
# autotuning, compression, sequence parallelism, 1-bit optimizers and data efficiency left it in stop 21.)
OUT_OF_SCOPE = {
    "hybrid_engine": "hybrid engine (own open issue)",
    "inference": "inference (own open issue)",
    "module_inject": "AutoTP / inference injection (own open issue)",
    "model_parallelism": "AutoTP (own open issue)",
    "linear": "OptimizedLinear / LoRA (own open issue)",
    "compile": "DeepCompile (own open issue)",
    "v1/compile": "DeepCompile (own open issue)",
    "runtime/half_precision/test_fp8.py": "FP8 needs Transformer Engine on CUDA",
    "runtime/zenflow": "ZenFlow (own open issue)",
    "runtime/rollout": "hybrid engine rollout (own open issue)",
    "runtime/tensor_parallel": "AutoTP (own open issue)",
    "runtime/zero/test_zeropp.py": "ZeRO++ (own open issue)",
    "checkpoint/test_mics_optimizer.py": "MiCS (own open issue)",
    "checkpoint/test_autotp_uc_checkpoint.py": "AutoTP (own open issue)",
    "v1/moe/test_autoep": "AutoEP (own open issue)",
    "v1/moe/test_fused_expert_layout.py": "AutoEP (own open issue)",
    "v1/nvme": "async I/O / GDS compiled ops",
    "v1/ops": "Triton kernels (CUDA)",
    "ops/": "compiled CUDA kernels (transformer, quantizer, sparse attention, ...): needs CUDA",
    "v1/multimodal": "model-specific AutoTP config (own open issue)",
    "runtime/test_tp_plan_extraction.py": "AutoTP (own open issue)",
    "runtime/test_mup_optimizers.py": "MuP / Muon optimizers (own open issue)",
    "runtime/test_engine_eigenvalue.py": "eigenvalue (own open issue)",
}
# CPU ops we do provide (take precedence over the "ops/" prefix above).
IN_SCOPE_OPS = ("ops/adam/test_cpu_adam.py", "ops/adam/test_adamw.py", "ops/adam/test_hybrid_adam.py",
                "ops/adagrad/", "ops/lion/", "ops/test_op_builder.py", "ops/accelerators/")

# Failing tests explained: (regex on the node id or on the message, category, reason).
# category "out_of_scope": needs CUDA / a compiled op / a feature with its own open issue;
# category "deviation": pins a DeepSpeed internal or limitation we deliberately do not copy
# (each one is listed with its reason in docs/api_surface.md, "DeepSpeed unit tests");
# category "remaining": a real gap, not closed yet (listed there too).
KNOWN = [
    # deliberate deviations (docs/api_surface.md, "DeepSpeed unit tests")
    (r"test_no_sync_ctxt\.py::TestNoSyncCtxt::test_zero_stage\[[23]-", "deviation",
     "no_sync() at ZeRO-2/3: DeepSpeed refuses it, we support it on purpose"),
    (r"test_user_args\.py::test_add_export_with_special_characters", "deviation",
     "exports are stored raw and quoted (shlex.quote) when the command is built, not stored pre-quoted"),
    (r"has no attribute 'all_gather_coalesced'|MultipleAllGatherHandles|InsertPostInitMethodToModuleSubClasses"
     r"|_external_params", "deviation", "pins ZeRO-3 internals (per-parameter gather methods, handle and "
     "init-hook classes, the module's external-parameter dict); ours gathers through GatheredParameters/hooks"),
    (r"TestMoESingleton::test_all_to_all", "deviation",
     "monkeypatches sharded_moe._AllToAll.apply (DeepSpeed's equal-split all-to-all, called as (group, input)) and "
     "counts its calls; MOELayer here sends only the occupied slots with exact per-rank splits (_AllToAllV), so "
     "there is no _AllToAll to count (passes on the real DeepSpeed on CPU)"),
    (r"comet\.experiment_key must be 32 to 50", "deviation",
     "the config checks Comet's documented experiment_key format (32-50 alphanumerics) and names the key; the "
     "test's mocked comet_ml.start takes 'some-experiment-key', which DeepSpeed's config passes through (the real "
     "comet_ml would refuse it at start). With comet_ml installed the rest of the test (start's six keyword "
     "arguments, set_name) is what tests/monitor/test_monitors.py checks"),
    (r"No module named 'comet_ml'", "out_of_scope",
     "needs the comet_ml package, not installed here (fails on the real DeepSpeed alike; with comet_ml 3.58.8 on "
     "PYTHONPATH test_empty_comet passes here and both pass on the real DeepSpeed)"),
    (r"test_pin_memory_tracker\.py::test_checkpoint_emits_info", "out_of_scope",
     "fails on the real DeepSpeed 0.19.6 on CPU alike (assert 2 == 1: caplog sees the one checkpoint record "
     "twice in this harness); the checkpoint ladder is checked in tests/upstream/test_upstream_causes.py"),
    (r"count_used_parameters_in_backward", "deviation", "patches count_used_parameters_in_backward inside "
     "DeepSpeed's ZeRO optimizers (stage_1_and_2 / stage3) and expects one call per backward: ours ends a "
     "user-driven backward with a callback queued on autograd's engine and counts nothing (the helper itself "
     "is provided in deepspeed.runtime.utils)"),
    (r"test_zero_hook_attribute_delegation\.py", "deviation",
     "pins the attributes DeepSpeed's ZeRO-3 hooks leave on each module (pre_bwd_fn, applied_pre_backward_ref_cnt)"),
    # features with their own open issue, or outside this package
    (r"ds_to_universal|AUTOEP|autoep", "out_of_scope", "offline ds_to_universal conversion / AutoEP metadata "
     "(our checkpoints are universal natively; AutoEP has its own issue)"),
    (r"Tutel is not installed|TUTEL", "out_of_scope", "Tutel is not used"),
]
# real gaps found and not closed in this pass (kept here so the tables say so; not deviations)
KNOWN += [
    (r"test_quantized_eigenvalue_config_parses|Unknown config key 'flops_profiler\.step'", "deviation",
     "the config carries keys DeepSpeed silently ignores (eigenvalue.model_name, quantize_training."
     "quantize_type/quantize_eigenvalue, flops_profiler.step); ours refuses an unknown key with a 'did you "
     "mean' error"),
    (r"adam_w_mode = False contradicts optimizer\.type 'AdamW'", "deviation",
     "type AdamW with adam_w_mode false is refused as a contradiction; DeepSpeed ignores adam_w_mode there"),
    (r"test_op_builder\.py", "out_of_scope", "reads DeepSpeed's own op_builder/builder.py source, which the "
     "driver does not stage (only tests/ is copied)"),
    (r"test_warmup_cosine_lr_unknown_warmup_type_falls_back_to_log", "deviation",
     "an unknown warmup_type is refused with an error naming the valid values, not silently run as 'log'"),
    (r"test_sum_gradient_allreduce_rejects_zenflow", "out_of_scope", "ZenFlow (own open issue): the "
     "zero_optimization.zenflow key is refused before the gradient_allreduce_op check"),
    (r"test_sum_gradient_allreduce_rejects_deepcompile", "out_of_scope", "DeepCompile (own open issue): the "
     "compile section is refused before the gradient_allreduce_op check"),
    (r"Post-clip norm should be < pre-clip norm for param",
     "out_of_scope", "flaky upstream: SimpleModel is built from an unseeded RNG (a different model in every process), "
     "and 'post-clip norm < pre-clip norm' holds only when some gradient element exceeds clip_value; a parameter whose "
     "norm exceeds it with every element inside fails on the real DeepSpeed alike"),
    (r"test_zero_optim_overflow\.py::.*test_ignore_grad_overflow", "deviation",
     "pins that bf16 with check_grad_overflow false applies a NaN/Inf gradient (every weight becomes NaN, no step "
     "skipped); here a non-finite global gradient norm skips the step with a warning naming it and counts it "
     "(issue 30 item 7: never silently poison the weights)"),
    (r"TestZero3ParamPartitioningBase::test_prefetching\[True\]", "deviation",
     "pins a layer's parameters AVAILABLE after its forward at stage3_max_reuse_distance 0 when prefetching: "
     "DeepSpeed keeps a parameter whose later use its prefetch queue has passed (the queue is consumed once per "
     "step, so a released one would not be prefetched again); ours rescans the trace at every fetch and "
     "releases as the reuse distance says (the rule raised the layer-sized transient peak 3.54 -> 3.93 bytes/param)"),
    (r"TestZero3ParamPartitioningBase::test_zero_grad\[True\]", "deviation",
     "DeepSpeed's ZeRO-3 optimizer.zero_grad() leaves the reduced gradient partitions in place (the next "
     "backward overwrites them), so a step right after zero_grad() still applies the last gradients (the test "
     "pins a non-zero norm); ours zeroes them: a step after zero_grad() sees zero gradients"),
    (r"test_zero_leaf_module\.py::.*test_no_grad_input_error", "deviation",
     "DeepSpeed refuses a leaf module whose inputs do not require grad (a limit of its hooks); ours runs it"),
    (r"get_allgather_dtype|test_zero_autocast_mixed_dtype", "deviation",
     "torch_autocast with 16-bit ZeRO-3 parameters (per-parameter comm dtypes, get_allgather_dtype): "
     "torch_autocast keeps fp32 parameters here and is not combined with bf16/fp16"),
    (r"TestGradientAllreduceOpTraining::test\[adamw", "out_of_scope",
     "the harness's allclose_on_all_ranks builds a tensor on get_accelerator().current_device(), which no CPU "
     "accelerator can (DeepSpeed's own returns the LOCAL_RANK string): fails on the real DeepSpeed on CPU too"),
    (r"TestGradientAllreduceOpTraining::test\[muon|ns_method", "out_of_scope",
     "DeepSpeed's Muon optimizer (ns_method, partitioned Newton-Schulz) belongs with MuP/Muon (own open issue)"),
    (r"fp32_groups_gradients_flat", "deviation",
     "pins BF16_Optimizer.fp32_groups_gradients_flat (the full reduced fp32 gradient held on every rank); ZeRO-1 "
     "here reduce-scatters, each rank holds its partition (safe_get_full_grad gives the full gradient)"),
    (r"nccl_start_alignment_factor|parallel_partitioned_bit16_groups", "deviation",
     "pins ZeRO-1/2's flat layout (one contiguous partition per rank, parallel_partitioned_bit16_groups); ours "
     "partitions each bucket (every rank owns a chunk of each bucket)"),
    (r"TestZeroOffloadOptim::test\[True\]", "deviation",
     "a client optimizer with ZeRO-Offload is accepted (its update runs on the host); DeepSpeed raises "
     "ZeRORuntimeException unless zero_force_ds_cpu_optimizer is false (Hugging Face Trainer hits that)"),
    (r"deepspeed\.runtime\.zero\.offload_states", "out_of_scope",
     "engine.offload_states/reload_states (moving ZeRO state to the host between RLHF phases) is not built; on CPU "
     "the module fails on the real DeepSpeed 0.19.6 too (its 'allocated memory should decrease' assertions: 17 of "
     "17 run failed, 2026-11-28)"),
    (r"test_overlap_comm_record_stream\.py|IPGBucket", "deviation",
     "pins stage_1_and_2 internals (IPGBucket, CUDA-stream record_stream, a module-level get_accelerator)"),
    (r"accumulated_grads_in_cpu", "deviation", "pins ZeRO-Offload's CPU accumulation buffer attribute"),
    (r"test_zero_activation_checkpoint_lifecycle\.py", "deviation",
     "pins ZeRO-3 internals: torch.nn.functional.linear patched to zero3_linear_wrap while ZeRO-3 is active (ours "
     "never replaces F.linear: gathered parameters keep their storage) and per-parameter ds_active_sub_modules"),
    (r"test_zero_autocast\.py::TestZeroAutoCast", "out_of_scope",
     "needs CUDA: raises unless bf16_required_version_check() (CUDA/NCCL) and builds DDP with device_ids on "
     "an accelerator; fails on the real DeepSpeed on CPU too"),
    # engine.coalesce_grad_reduction() (runtime/torch_backward.py): what differs from DeepSpeed's internals
    (r"test_zero1_no_offload_uses_bf16_optimizer", "deviation",
     "ZeRO-1 + bf16 + grad_accum_dtype fp32 without offload: DeepSpeed routes it to BF16_Optimizer, which "
     "coalesce_grad_reduction refuses (NotImplementedError); here every ZeRO-1 configuration runs on one "
     "flat-master strategy and the block works there too"),
    (r"test_coalesce_issues_fewer_collectives\[3\]", "deviation",
     "counts calls of deepspeed.comm.all_reduce / reduce / reduce_scatter_fn; ZeRO-3 here reduce-scatters "
     "through deepspeed.comm.reduce_scatter(_tensor), so the counters see none (one reduction per block is "
     "checked in tests/runtime/test_torch_backward.py from the reducer's launch count)"),
    (r"_flush_coalesced_reduction_zero3|micro_step_id", "deviation",
     "pins DeepSpeed's ZeRO-3 flush helper (engine._flush_coalesced_reduction_zero3) and optimizer.micro_step_id"),
    (r"TestZero0DirectBackwardStillRaises", "deviation",
     "a user-driven loss.backward() works at ZeRO stage 0 here (DeepSpeed refuses it there with 'Direct calls to "
     "tensor.backward'); recorded with the user-driven backward's deviations"),
    (r"test_existing_no_sync_still_blocked_for_zero2", "deviation",
     "no_sync() at ZeRO-2/3: DeepSpeed refuses it, we support it on purpose"),
    (r"test_zero_user_backward\.py::TestZeroUserBackwardWithScale::test_scale_backward_matches_engine_backward",
     "out_of_scope", "the gradients are computed; the harness's allclose_on_all_ranks then builds a tensor on "
     "get_accelerator().current_device(), which no CPU accelerator can (fails on the real DeepSpeed on CPU too; "
     "engine.scale(loss).backward() == engine.backward(loss) is checked in tests/runtime/test_torch_backward.py)"),
    (r"TestUnmanagedGradientAccumulation.*::test_unmanaged_(matches_managed|varying_backward_count)", "out_of_scope",
     "managed_gradient_accumulation: false trains; the harness's compare_parameters -> allclose_on_all_ranks then "
     "builds its flag tensor on get_accelerator().current_device(), which no CPU accelerator can (fails on the real "
     "DeepSpeed on CPU too). With that helper made CPU-safe in a scratch copy all 16 pass; the same checks against "
     "plain PyTorch: tests/runtime/test_unmanaged_grad_accum.py"),
    (r"deepspeed\.runtime\.base_optimizer", "deviation",
     "imports deepspeed.runtime.base_optimizer.ZeROOptimizer (absent by design: our optimizer objects do not "
     "share DeepSpeed's base classes, docs/api_surface.md); what these tests check - optimizer.needs_scaler() and "
     "the fp16 refusal of an unscaled loss.backward() - is provided (test_error_when_backward_without_scale_fp16)"),
    (r"test_nvtx\.py", "out_of_scope", "imports DeepSpeed's top-level accelerator package (cuda_accelerator); "
     "NVTX ranges are not used here (the module does not collect on the real DeepSpeed 0.19.6 installed from its "
     "wheel either)"),
    (r"test_byte_cast\.py::.*test_byte_cast_cpu_tensor\[True", "out_of_scope",
     "calls torch's Tensor.pin_memory(), which needs an accelerator (on the real DeepSpeed 0.19.6 on CPU the whole "
     "module is skipped: its UtilsBuilder is not compatible there)"),
    (r"DistributedDataParallel device_ids and output_device", "out_of_scope",
     "the test's DDP reference is built with device_ids (an accelerator): fails on the real DeepSpeed on CPU too"),
    (r"deepspeed\.sequence\.fpdt_layer", "out_of_scope", "FPDT (fully pipelined distributed transformer "
     "attention with host offload) is not built; sequence_parallelism/test_ulysses.py imports it"),
    (r"couldn't connect to 'https://huggingface\.co'", "out_of_scope",
     "downloads a model from the Hugging Face hub (no network on this machine)"),
    (r"Torch not compiled with CUDA enabled", "out_of_scope", "needs CUDA"),
    (r"TestUlyssesSPHFFlexAttention", "out_of_scope", "PyTorch's FlexAttention has no backward on CPU"),
    (r"test_stage2_flatten_on_gpu\.py|bit16_groups_flat", "deviation",
     "pins stage_1_and_2 internals (bit16_groups_flat and its 'Flattening param group' log line)"),
    (r"test_cpu_(adam|adagrad|lion)_gpu_error", "out_of_scope",
     "expects the CPU optimizer to refuse a tensor on the accelerator; on CPU device_name(0) is 'cpu', so the "
     "test fails on the real DeepSpeed on CPU too"),
    (r"TestOptimizerImplementation::test\[fp32-(fp16|bf16)-None\]", "deviation",
     "fp32 gradient accumulation of 16-bit training without ZeRO is built here (FP16_Optimizer / BF16_Optimizer "
     "with fp32 gradient buffers); DeepSpeed raises NotImplementedError for it"),
    (r"comm_backend_name = 'gloo'", "out_of_scope",
     "the 1-bit optimizers take comm_backend_name from get_accelerator().communication_backend_name(), 'gloo' "
     "on CPU: DeepSpeed has no 1-bit backend of that name (comm_backend_handle stays None, its __init__ fails), "
     "so this fails on the real DeepSpeed on CPU too; here 'compressed' runs on gloo"),
    (r"has no attribute 'unscale_and_clip_grads'", "deviation",
     "monkeypatches FP16_Optimizer.unscale_and_clip_grads (an internal hook, different signatures fused / unfused) "
     "to see one grad norm on every rank; the MoE step here decides the global norm once (moe/training.py)"),
]


def classify(nodeid: str, message: str):
    for pattern, category, reason in KNOWN:
        if re.search(pattern, nodeid) or re.search(pattern, message or ""):
            return category, reason
    return None, None


# ----------------------------------------------------------------------------------------------
def resolve_source(arg: str | None) -> tuple[str, str]:
    """Return (a directory holding tests/unit, a description of where it came from)."""
    src = arg or os.environ.get("DS_UPSTREAM_REPO")
    if not src:
        if not os.path.isdir(DEFAULT_MIRROR):
            sys.exit("run_upstream: no DeepSpeed repository given (--ds-repo or $DS_UPSTREAM_REPO) "
                     f"and the default mirror {DEFAULT_MIRROR} is absent")
        src = DEFAULT_MIRROR
    src = os.path.abspath(os.path.expanduser(src))
    if os.path.isdir(os.path.join(src, "tests", "unit")):
        return src, f"work tree {src}"
    if os.path.isfile(os.path.join(src, "HEAD")) and os.path.isdir(os.path.join(src, "objects")):
        rev = subprocess.run(["git", "-C", src, "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dest = os.path.join(tempfile.gettempdir(), f"ds_upstream_src_{rev[:12]}")
        if not os.path.isdir(os.path.join(dest, "tests", "unit")):
            os.makedirs(dest, exist_ok=True)
            archive = subprocess.Popen(["git", "-C", src, "archive", "HEAD", "tests"], stdout=subprocess.PIPE)
            subprocess.run(["tar", "-x", "-C", dest], stdin=archive.stdout, check=True)
            archive.wait()
        return dest, f"bare repository {src} at {rev}"
    sys.exit(f"run_upstream: {src} holds neither tests/unit nor a bare git repository")


def stage_tests(source: str, workdir: str) -> str:
    """Copy <source>/tests (nothing else) into workdir; return the copied tests directory."""
    dest = os.path.join(workdir, "tests")
    if os.path.isdir(dest):
        shutil.rmtree(dest)
    shutil.copytree(os.path.join(source, "tests"), dest,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache"))
    _patch_worker_failures(os.path.join(dest, "unit", "common.py"))
    return dest


# Upstream's DistributedTest runs each rank in a multiprocessing.Pool worker and re-raises what
# the test raised. pytest's own outcomes (``pytest.fail``, "DID NOT RAISE" from pytest.raises)
# derive from BaseException, which the pool's worker does not catch: the worker dies, the pool
# never gets a result and the test hangs until the harness's timeout. The staged copy re-raises
# them as an AssertionError carrying the message, so such a test fails at once, with its message.
_WORKER_RAISE = "            else:\n                raise e\n"
_WORKER_RAISE_FIXED = ("            elif isinstance(e, Exception):\n                raise e\n"
                       "            else:  # run_upstream.py: pytest outcomes are BaseExceptions a Pool worker drops\n"
                       "                raise AssertionError(f'{type(e).__name__}: {e}') from None\n")


def _patch_worker_failures(common_py: str) -> None:
    if not os.path.isfile(common_py):
        return
    with open(common_py) as f:
        text = f.read()
    if text.count(_WORKER_RAISE) == 1:
        with open(common_py, "w") as f:
            f.write(text.replace(_WORKER_RAISE, _WORKER_RAISE_FIXED))
    else:
        print("note: tests/unit/common.py: worker re-raise not found; pytest.fail in a worker may hang "
              "until the harness timeout", file=sys.stderr)


def out_of_scope_reason(module: str):
    if module.startswith(IN_SCOPE_OPS):
        return None
    for prefix, why in OUT_OF_SCOPE.items():
        if module == prefix or module.startswith(prefix.rstrip("/") + "/") or module.startswith(prefix):
            return why
    return None


def all_modules(unit_dir: str) -> list[str]:
    found = []
    for root, _, files in os.walk(unit_dir):
        for f in files:
            if f.startswith("test_") and f.endswith(".py"):
                found.append(os.path.relpath(os.path.join(root, f), unit_dir))
    return sorted(found)


def _read_events(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut short by a kill
    return out


def _kill_group(proc: subprocess.Popen) -> None:
    """End the process group this driver started for one pytest run (pool workers included)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_module(module: str, tests_dir: str, args, scratch: str, targets=None) -> dict:
    """Run one module to completion, resuming after hangs; return its record. ``targets``: node ids
    (relative to the staged tests directory) to run instead of the whole module (``--rerun-failing``)."""
    unit_rel = os.path.join("unit", module)
    events_path = os.path.join(scratch, "events.jsonl")
    deselect_path = os.path.join(scratch, "deselect.txt")
    for p in (events_path, deselect_path):
        if os.path.exists(p):
            os.remove(p)
    env = dict(os.environ)
    env.update(
        DS_ACCELERATOR="cpu", LOCAL_SIZE=str(args.max_world_size), DS_UPSTREAM_EVENTS=events_path,
        DS_UPSTREAM_DESELECT=deselect_path, DS_UPSTREAM_EXPECT=OUR_PACKAGE,
        DS_UNITTEST_TIMEOUT=str(max(30, args.test_timeout - 15)), CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=os.pathsep.join([HERE] + ([os.path.dirname(OUR_PACKAGE)] if args.package_root else [])
                                   + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
        PATH=os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")]),   # the `deepspeed` CLI
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
    )
    env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("LOCAL_RANK", None)
    record = {"module": module, "tests": {}, "collect_errors": [], "attempts": 0, "seconds": 0.0,
              "module_timeout": False, "note": ""}
    start = time.time()
    hung: set = set()
    while True:
        record["attempts"] += 1
        remaining = args.module_timeout - (time.time() - start)
        if remaining <= 5:
            record["module_timeout"] = True
            break
        cmd = [sys.executable, "-m", "pytest", *(targets or [unit_rel]), "-p", "upstream_plugin",
               "-p", "no:cacheprovider",
               "-p", "timeout", f"--timeout={args.test_timeout}", "--timeout-method=thread",
               "-q", "-rN", "--no-header", "-o", "addopts=" + args.addopts]
        if args.k:
            cmd += ["-k", args.k]
        log_path = os.path.join(scratch, f"attempt{record['attempts']}.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=tests_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                rc = None
            _kill_group(proc)
            if rc is None:
                proc.wait()
        events = _read_events(events_path)
        started, finished = [], set()
        for ev in events:
            if ev["event"] == "start":
                started.append(ev["nodeid"])
            elif ev["event"] == "done":
                finished.add(ev["nodeid"])
                record["tests"][ev["nodeid"]] = {"outcome": ev["outcome"], "message": ev["message"]}
            elif ev["event"] == "collect_error":
                if ev not in record["collect_errors"]:
                    record["collect_errors"].append({"nodeid": ev["nodeid"], "message": ev["message"]})
        new_hung = [n for n in started if n not in finished and n not in hung]
        for n in new_hung:
            hung.add(n)
            why = "module budget exhausted" if rc is None else f"process ended (rc={rc}) mid-test"
            record["tests"][n] = {"outcome": "hung", "message": f"no result: {why}"}
        if rc is None:
            record["module_timeout"] = True
            break
        if not new_hung:
            if rc not in (0, 1, 5) and not record["tests"] and not record["collect_errors"]:
                with open(log_path) as f:
                    tail = f.read()[-1500:]
                record["collect_errors"].append({"nodeid": module, "message": f"pytest rc={rc}: {tail.strip()[-400:]}"})
            break
        with open(deselect_path, "w") as f:  # resume after the hung test(s)
            f.write("\n".join(list(record["tests"])) + "\n")
    record["seconds"] = round(time.time() - start, 1)
    apply_known(record)
    return record


def apply_known(record: dict) -> None:
    for nodeid, t in record["tests"].items():
        t.pop("known", None)
        if t["outcome"] in ("failed", "error", "hung"):
            category, reason = classify(nodeid, t["message"])
            if category:
                t["known"] = {"category": category, "reason": reason}
    for e in record["collect_errors"]:
        e.pop("known", None)
        category, reason = classify(e["nodeid"], e["message"])
        if category:
            e["known"] = {"category": category, "reason": reason}


def tally(record: dict) -> dict:
    c = {k: 0 for k in ("passed", "failed", "error", "hung", "skipped", "known")}
    for t in record["tests"].values():
        c[t["outcome"]] = c.get(t["outcome"], 0) + 1
        if "known" in t:
            c["known"] += 1
    c["collect_errors"] = len(record["collect_errors"])
    c["known"] += sum(1 for e in record["collect_errors"] if "known" in e)
    return c


def print_table(records: list[dict], out=sys.stdout) -> dict:
    cols = ("passed", "failed", "error", "hung", "skipped", "collect_errors", "known")
    heads = ("pass", "fail", "err", "hung", "skip", "coll", "known")
    width = max([len(r["module"]) for r in records] + [10])
    print(f"{'module':<{width}} " + " ".join(f"{h:>5}" for h in heads) + "   secs", file=out)
    total = {k: 0 for k in cols}
    for r in records:
        c = tally(r)
        for k in cols:
            total[k] += c.get(k, 0)
        flag = " (module budget hit)" if r.get("module_timeout") else ""
        print(f"{r['module']:<{width}} " + " ".join(f"{c.get(k, 0):>5}" for k in cols)
              + f" {r['seconds']:>6}{flag}", file=out)
    print(f"{'TOTAL':<{width}} " + " ".join(f"{total[k]:>5}" for k in cols), file=out)
    return total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ds-repo", help="DeepSpeed work tree or bare git repository (default: $DS_UPSTREAM_REPO, "
                    f"else {DEFAULT_MIRROR})")
    ap.add_argument("--modules", nargs="*", help="module paths under tests/unit, or node ids like "
                    "'v1/zero/test_zero.py::TestZeroToFP32' (default: the relevant set)")
    ap.add_argument("--all", action="store_true", help="every test module except the out-of-scope ones")
    ap.add_argument("-k", help="pytest -k expression applied to every module")
    ap.add_argument("--test-timeout", type=int, default=int(os.environ.get("DS_UPSTREAM_TEST_TIMEOUT", "240")),
                    help="seconds per test (pytest-timeout)")
    ap.add_argument("--module-timeout", type=int, default=int(os.environ.get("DS_UPSTREAM_MODULE_TIMEOUT", "1200")),
                    help="seconds per module, all attempts together")
    ap.add_argument("--max-world-size", type=int, default=2)
    ap.add_argument("--addopts", default='-m "not sequential and not nightly and not inference and not seq_inference '
                    'and not inference_ops and not inference_v2 and not inference_v2_ops and not stable_diffusion '
                    'and not evaluation"', help="replaces upstream pytest.ini's addopts (its marker filter by default)")
    ap.add_argument("--json", default=os.environ.get("DS_UPSTREAM_JSON",
                                                     os.path.join(tempfile.gettempdir(), "upstream_unit.json")))
    ap.add_argument("--workdir", help="scratch directory (default: a fresh temporary one)")
    ap.add_argument("--package-root", help="run against the deepspeed package in this directory instead of this "
                    "checkout's (e.g. a git worktree of an older commit, for a before/after comparison)")
    ap.add_argument("--rerun-failing", metavar="JSON", help="run only what did not pass in this saved summary "
                    "(failed / error / hung tests by node id; a module that did not collect as a whole), e.g. with "
                    "--package-root pointing at another deepspeed to learn how those tests fare there")
    ap.add_argument("--reclassify", metavar="JSON", help="re-apply KNOWN to a saved summary, rewrite it and print "
                    "its table (runs nothing)")
    args = ap.parse_args(argv)
    if args.reclassify:
        with open(args.reclassify) as f:
            summary = json.load(f)
        for r in summary["modules"]:
            apply_known(r)
            r["counts"] = tally(r)
        summary["total"] = print_table(summary["modules"])
        print_not_passing(summary["modules"])
        with open(args.reclassify, "w") as f:
            json.dump(summary, f, indent=1)
        return 0
    global OUR_PACKAGE
    if args.package_root:
        OUR_PACKAGE = os.path.join(os.path.abspath(args.package_root), "deepspeed")

    source, where = resolve_source(args.ds_repo)
    workdir = args.workdir or tempfile.mkdtemp(prefix="ds_upstream_run_")
    os.makedirs(workdir, exist_ok=True)
    tests_dir = stage_tests(source, workdir)
    unit_dir = os.path.join(tests_dir, "unit")
    targets_of = {}
    if args.rerun_failing:
        targets_of = failing_targets(args.rerun_failing, args.modules)
        modules = list(targets_of)
    elif args.modules:
        modules = args.modules
    elif args.all:
        modules = all_modules(unit_dir)
    else:
        modules = DEFAULT_MODULES
    print(f"upstream tests from {where}; staged in {tests_dir}; ours: {OUR_PACKAGE}", flush=True)
    records, skipped_modules = [], {}
    for module in modules:
        why = out_of_scope_reason(module)
        if why and not args.modules and not args.rerun_failing:
            skipped_modules[module] = why
            continue
        if not os.path.exists(os.path.join(unit_dir, module.split("::")[0])):
            records.append({"module": module, "tests": {}, "collect_errors": [
                {"nodeid": module, "message": "no such module in this DeepSpeed copy"}], "seconds": 0.0})
            continue
        scratch = os.path.join(workdir, "runs", re.sub(r"[^A-Za-z0-9_.-]", "_", module))
        os.makedirs(scratch, exist_ok=True)
        rec = run_module(module, tests_dir, args, scratch, targets_of.get(module))
        records.append(rec)
        c = tally(rec)
        print(f"[{len(records)}/{len(modules)}] {module}: " + ", ".join(f"{k} {v}" for k, v in c.items() if v)
              + f" ({rec['seconds']}s)", flush=True)
        _write_json(args.json, where, args, records, skipped_modules)
    print()
    total = print_table(records)
    print_not_passing(records)
    _write_json(args.json, where, args, records, skipped_modules, total)
    print(f"\nJSON summary: {args.json}")
    return 0


def failing_targets(path: str, only_modules=None) -> dict:
    """module -> node ids that did not pass in the summary at ``path`` (None: rerun the whole module,
    it did not collect). ``only_modules`` narrows it to those module entries."""
    with open(path) as f:
        summary = json.load(f)
    out = {}
    for r in summary["modules"]:
        if only_modules and r["module"] not in only_modules:
            continue
        ids = [n for n, t in r["tests"].items() if t["outcome"] in ("failed", "error", "hung")]
        if r["collect_errors"]:
            out[r["module"]] = None
        elif ids:
            out[r["module"]] = ids
    return out


def print_not_passing(records) -> None:
    print("\nnot passing:")
    for r in records:
        for e in r["collect_errors"]:
            tag = f" [{e['known']['category']}: {e['known']['reason']}]" if "known" in e else ""
            print(f"  COLLECT {e['nodeid']}: {e['message'][:200]}{tag}")
        for nodeid, t in r["tests"].items():
            if t["outcome"] in ("failed", "error", "hung"):
                tag = f" [{t['known']['category']}: {t['known']['reason']}]" if "known" in t else ""
                print(f"  {t['outcome'].upper():6} {nodeid}: {t['message'][:200]}{tag}")


def _write_json(path, where, args, records, skipped_modules, total=None):
    import torch
    summary = {
        "source": where, "ours": OUR_PACKAGE, "torch": torch.__version__,
        "test_timeout_s": args.test_timeout, "module_timeout_s": args.module_timeout,
        "max_world_size": args.max_world_size, "k": args.k,
        "modules": [dict(r, counts=tally(r)) for r in records],
        "out_of_scope_modules": skipped_modules,
        "total": total or {},
    }
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1, sort_keys=False)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())

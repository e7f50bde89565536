"""Drive this package through the REAL PyTorch Lightning ``DeepSpeedStrategy`` and TRL
``SFTTrainer`` (launched by ``test_lightning_trl.py`` with ``torchrun``, 2 CPU processes).

One launch runs every case one after another (start-up and imports paid once); rank 0
writes what it saw to a JSON file the test checks.

* Lightning, ZeRO stage 2 and 3: an uninterrupted ``fit`` of 4 steps (2 epochs of 2 steps
  per rank) that also saves a DeepSpeed checkpoint directory at the end of epoch 0
  (``ModelCheckpoint``, so through ``DeepSpeedStrategy.save_checkpoint``); a second ``fit`` from
  a differently initialised model with ``ckpt_path=`` that checkpoint; then, on rank 0,
  ``lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict`` on it
  and ``LightningModule.load_from_checkpoint`` of the file it writes.
* TRL ``SFTTrainer``, ZeRO stage 2 (tied embeddings) and 3 (untied: TRL's fused LM-head
  loss reads ``lm_head.weight`` inside the model's forward while ``lm_head`` itself never
  runs, a parameter used outside its own module under ZeRO-3); a tiny Llama built from a
  config and a word-level tokenizer built in memory: 4 steps saving ``checkpoint-2``, then
  ``resume_from_checkpoint`` in a new trainer.

The Lightning shim (``lightning_cpu_shim``) patches two Lightning functions and nothing of
ours: ``DeepSpeedStrategy.setup_environment`` raises unless the accelerator is CUDA (the
shim uses its parent's, ``DDPStrategy.setup_environment``: the same method minus that
check), and ``_validate_device_index_selection`` requires device indices 0..N-1, which CPU
devices lack (the shim checks only devices that have an index). Accelerate's CPU
multi-process view comes from ``hf_driver``'s shim.

Usage: ``lightning_trl_driver.py --part lightning,trl --out RESULT.json --work DIR [--stages 2,3] [--tied-too]``
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_driver as H  # noqa: E402  (environment defaults, Accelerate CPU shim, client resets)

import torch  # noqa: E402

torch.set_num_threads(1)
rank = H.rank


def gathered(module):
    """Full fp32 copies of ``module``'s parameters (collective under ZeRO-3)."""
    import deepspeed
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def max_diff(a, b):
    if set(a) != set(b):
        return f"keys differ: {sorted(set(a) ^ set(b))}"
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# ------------------------------------------------------------------ Lightning
def lightning_cpu_shim():
    """Let Lightning's DeepSpeedStrategy run on CPU. Two Lightning functions refuse it, and
    only they are patched: ``DeepSpeedStrategy.setup_environment`` raises unless the
    accelerator is CUDA before calling ``DDPStrategy.setup_environment`` (use the latter), and
    ``_validate_device_index_selection`` (called in ``setup_distributed``) wants device
    indices 0..N-1, which CPU devices do not have (check only devices that have an index)."""
    import lightning.pytorch.strategies.deepspeed as lds
    from lightning.pytorch.strategies.ddp import DDPStrategy
    lds.DeepSpeedStrategy.setup_environment = DDPStrategy.setup_environment
    check = lds._validate_device_index_selection

    def validate_indexed_devices(parallel_devices):
        indexed = [d for d in parallel_devices if d.index is not None]
        if indexed:
            check(indexed)

    lds._validate_device_index_selection = validate_indexed_devices


def _lightning_module_class():
    import lightning.pytorch as pl

    class LitRegressor(pl.LightningModule):
        def __init__(self, seed: int = 0, lr: float = 0.02):
            super().__init__()
            self.save_hyperparameters()
            torch.manual_seed(seed)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                           torch.nn.Tanh(), torch.nn.Linear(16, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.0)

    return LitRegressor


def lightning_samples():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 8, generator=g)
    y = torch.stack([x[:, :4].sum(1), x[:, 4:].sum(1), (x[:, 0] * x[:, 1]), x[:, 2] - x[:, 3]], 1) * 0.5
    return x, y


def _lightning_data():
    # 8 samples, 2 ranks, 4 per batch: one step per epoch, and every step's global batch is all
    # 8 samples whatever order Lightning's DistributedSampler deals them in (so an uninterrupted
    # run, a resumed one and a plain full-batch reference see the same global batches)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*lightning_samples()), batch_size=4)


def run_lightning(stage: int, work: str) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict
    Lit = _lightning_module_class()
    root = os.path.join(work, f"lightning_z{stage}")
    rec = {}

    class Record(Callback):
        def __init__(self, key):
            self.key = key
            rec[key] = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            # the global batch's loss: the mean of the ranks' losses (equal halves)
            rec[self.key].append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

        def on_train_epoch_end(self, trainer, module):
            if self.key == "full" and trainer.global_step == 2:
                rec["params_step2"] = gathered(module)

    def strategy():
        # Lightning's own default config for the stage, every parameter partitioned at stage 3
        # (its default persistence threshold would keep this tiny model whole)
        config = DeepSpeedStrategy(stage=stage).config
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        return DeepSpeedStrategy(config=config)

    def trainer(key, **kw):
        return pl.Trainer(accelerator="cpu", devices=2, num_nodes=1, max_steps=4, logger=False,
                          enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                          strategy=strategy(), precision="32-true",
                          default_root_dir=root, callbacks=[Record(key)] + kw.pop("callbacks", []), **kw)

    ckpt_cb = ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_epochs=2, save_top_k=-1,
                              save_on_train_epoch_end=True, enable_version_counter=False)
    full_model = Lit(seed=0)
    t = trainer("full", callbacks=[ckpt_cb])
    t.fit(full_model, _lightning_data())
    full_params = gathered(full_model)
    ckpt = os.path.join(root, "ckpt", "epoch=1-step=2.ckpt")
    out = {"losses": rec["full"], "params": {k: v.tolist() for k, v in full_params.items()}, "ckpt_files": sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else None,
           "engine": type(t.strategy.deepspeed_engine).__module__}
    if os.path.isdir(ckpt):
        out["ckpt_tag_files"] = sorted(os.listdir(os.path.join(ckpt, "checkpoint")))
    t.strategy.barrier()

    resumed_model = Lit(seed=123)   # other initial weights: everything must come from the checkpoint
    t2 = trainer("resumed")
    t2.fit(resumed_model, _lightning_data(), ckpt_path=ckpt)
    out["resumed_losses"] = rec["resumed"]
    out["resumed_global_step"] = t2.global_step
    out["resumed_params_diff"] = max_diff(gathered(resumed_model), full_params)
    t2.strategy.barrier()
    if rank() == 0:
        conv_file = os.path.join(root, "converted.pt")
        client = convert_zero_checkpoint_to_fp32_state_dict(ckpt, conv_file)
        out["converted_keys"] = sorted(k for k in client if k != "state_dict")
        out["converted_epoch_step"] = [client.get("epoch"), client.get("global_step")]
        out["converted_diff"] = max_diff(client["state_dict"], rec["params_step2"])
        loaded = Lit.load_from_checkpoint(conv_file, map_location="cpu", weights_only=False)
        out["load_from_checkpoint_diff"] = max_diff(dict(loaded.named_parameters()), rec["params_step2"])
        out["loaded_hparams"] = dict(loaded.hparams)
    t2.strategy.barrier()
    return out


# ------------------------------------------------------------------ TRL
VOCAB, SEQ = 24, 12


def _tokenizer():
    """A word-level tokenizer built in memory (no download): words ``w0 .. w{VOCAB-1}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    vocab.update({f"w{i}": i + 3 for i in range(VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _text_dataset(n=32):
    """Learnable sequences: w[t+1] = (5 w[t] + 3) mod VOCAB from a random start."""
    from datasets import Dataset
    g = torch.Generator().manual_seed(1)
    rows = []
    for s in torch.randint(0, VOCAB, (n,), generator=g).tolist():
        row = [s]
        for _ in range(SEQ - 1):
            row.append((5 * row[-1] + 3) % VOCAB)
        rows.append(" ".join(f"w{i}" for i in row))
    return Dataset.from_dict({"text": rows})


def _tiny_llama(vocab_size, tied):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    return LlamaForCausalLM(cfg)


def run_trl(stage: int, work: str, resume: bool, tied: bool) -> dict:
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer
    H.reset_clients()
    out_dir = os.path.join(work, f"trl_z{stage}_{'tied' if tied else 'untied'}")
    tok = _tokenizer()
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "gradient_clipping": "auto",
          # every parameter partitioned (the default threshold would keep this tiny model whole)
          "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    args = SFTConfig(output_dir=out_dir, per_device_train_batch_size=4, max_steps=4, learning_rate=2e-2,
                     lr_scheduler_type="constant", weight_decay=0.0, logging_steps=1, save_strategy="steps",
                     save_steps=2, report_to=[], deepspeed=ds, seed=0, data_seed=0, disable_tqdm=True,
                     dataloader_num_workers=0, save_only_model=False, max_length=SEQ + 2, packing=False,
                     max_grad_norm=0.0, dataset_num_proc=None, bf16=False)
    model = _tiny_llama(len(tok), tied)
    seen = {"lm_head_external": None}

    class Probe(TrainerCallback):
        def on_step_end(self, a, state, control, model=None, **kw):
            if seen["lm_head_external"] is None and stage == 3:
                ext = trainer.model_wrapped.module.__dict__.get("_external_params", {})
                seen["lm_head_external"] = any(p is trainer.model.lm_head.weight for p in ext.values())

    trainer = SFTTrainer(model=model, args=args, train_dataset=_text_dataset(), processing_class=tok,
                         callbacks=[Probe()])
    trainer.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-2") if resume else None)
    hist = trainer.state.log_history
    res = {"losses": [h["loss"] for h in hist if "loss" in h], "steps": [h["step"] for h in hist if "loss" in h],
           "params": gathered(trainer.model), "engine": type(trainer.model_wrapped).__module__, **seen}
    if not resume:
        ck = os.path.join(out_dir, "checkpoint-2")
        res["checkpoint_files"] = sorted(os.listdir(ck)) if os.path.isdir(ck) else None
    trainer.model_wrapped.destroy()
    del trainer
    return res


def trl_pair(stage, work, tied):
    full = run_trl(stage, work, resume=False, tied=tied)
    resumed = run_trl(stage, work, resume=True, tied=tied)
    # the resumed trainer's log history starts with the checkpoint's (steps 1-2)
    new = [(s, x) for s, x in zip(resumed["steps"], resumed["losses"]) if s > 2]
    return {"losses": full["losses"], "steps": full["steps"], "resumed_losses": [x for _, x in new],
            "resumed_steps": [s for s, _ in new], "resumed_params_diff": max_diff(resumed["params"], full["params"]),
            "engine": full["engine"], "lm_head_external": full["lm_head_external"],
            "checkpoint_files": full["checkpoint_files"]}


# ------------------------------------------------------------------ main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", required=True, help="comma-separated: lightning, trl")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--tied-too", dest="tied_too", action="store_true",
                    help="TRL: run both tied and untied embeddings at every stage (default: tied at 2, untied at 3)")
    a = ap.parse_args()
    stages = [int(s) for s in a.stages.split(",")]
    runs = {}
    for part in a.part.split(","):
        if part == "lightning":
            lightning_cpu_shim()
            runs.update({f"lightning_z{s}": (lambda s=s: run_lightning(s, a.work)) for s in stages})
        elif part == "trl":
            import transformers
            transformers.logging.set_verbosity_error()
            H.cpu_multiprocess_shim()
            # ZeRO-3 with an untied head: the fused loss reads lm_head.weight, a parameter of a module
            # that never runs (tied, the embedding keeps it gathered for reuse)
            runs.update({f"trl_z{s}_{'tied' if t else 'untied'}": (lambda s=s, t=t: trl_pair(s, a.work, t))
                         for s in stages for t in ((False, True) if a.tied_too else (s == 2,))})
        else:
            ap.error(f"--part: unknown {part!r}; choose from lightning, trl")
    results = {}
    for name, fn in runs.items():
        try:
            results[name] = {"ok": True, **fn()}
        except Exception as err:  # noqa: BLE001 - record, keep going, the test reports it
            results[name] = {"ok": False, "error": f"{type(err).__name__}: {err}",
                             "traceback": traceback.format_exc()[-4000:]}
            print(f"[rank {rank()}] {name} FAILED: {results[name]['traceback']}", file=sys.stderr, flush=True)
        if rank() == 0:
            print(f"[driver] {name}: {'ok' if results[name]['ok'] else results[name]['error']}", flush=True)
    if rank() == 0:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()

"""Train a tiny Llama through the REAL Hugging Face Trainer with DeepSpeed sequence parallelism
(Accelerate's ParallelismConfig(sp_backend="deepspeed")) or without it; rank 0 writes the logged
losses and gradient norms. Usage (launched by test_trainer_sp.py):
``torchrun --nproc_per_node SP trainer_sp_driver.py SP OUT.json``."""
import json, os, sys
os.environ.setdefault("HF_HUB_OFFLINE", "1"); os.environ.setdefault("ACCELERATE_DISABLE_RICH", "1")
import torch
torch.set_num_threads(1)
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
sp = int(sys.argv[1]); out = sys.argv[2]
SEQ, N = 16, 8
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
model = LlamaForCausalLM(cfg)
g = torch.Generator().manual_seed(1)
ids = torch.randint(1, 64, (1, SEQ), generator=g).expand(N, SEQ).clone()  # one sequence: the order of samples cannot matter
class DS(torch.utils.data.Dataset):
    def __len__(self): return N
    def __getitem__(self, i): return {"input_ids": ids[i], "labels": ids[i], "position_ids": torch.arange(SEQ)}
ds_cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0},
          "gradient_clipping": 0.0, "train_batch_size": "auto"}
kw = {}
if sp > 1:
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
    kw["parallelism_config"] = ParallelismConfig(sp_backend="deepspeed", sp_size=sp,
        sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length=SEQ, sp_seq_length_is_variable=True,
                                                   sp_attn_implementation="sdpa"))
args = TrainingArguments(output_dir=os.path.join(os.path.dirname(out), f"o{sp}"), per_device_train_batch_size=1,
                         learning_rate=1e-2, max_steps=3, logging_steps=1, report_to=[], deepspeed=ds_cfg,
                         save_strategy="no", use_cpu=True, max_grad_norm=0.0, lr_scheduler_type="constant",
                         dataloader_drop_last=True, seed=0, **kw)
tr = Trainer(model=model, args=args, train_dataset=DS())
tr.train()
if torch.distributed.get_rank() == 0:
    json.dump({"losses": [h["loss"] for h in tr.state.log_history if "loss" in h], "grad_norm": [h["grad_norm"] for h in tr.state.log_history if "grad_norm" in h]}, open(out, "w"))

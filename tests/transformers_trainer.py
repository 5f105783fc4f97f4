"""An unmodified transformers Trainer fine-tunes a tiny Bert (built from a config: nothing is
downloaded) on generated variable-length sentences with DataCollatorWithPadding, after one
line: shmloader.install(). Records every batch it trained on and whether its memory was a
shmloader mapping. Usage: transformers_trainer.py OUT_DIR MAX_STEPS fresh|resume.
Run by tests/integration/test_ecosystem.py."""
import json
import pathlib
import sys

sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])  # the repo, not tests/ (its datasets.py would shadow HF datasets)

import torch
from transformers import BertConfig, BertForSequenceClassification, DataCollatorWithPadding, Trainer, TrainingArguments

import shmloader


class Sentences(torch.utils.data.Dataset):
    def __len__(self): return 96
    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        n = int(torch.randint(4, 40, (1,), generator=g))
        ids = torch.randint(5, 100, (n,), generator=g).tolist()
        return {"input_ids": ids, "attention_mask": [1] * n, "labels": int(sum(ids) % 2)}

class Tok:  # what DataCollatorWithPadding needs from a tokenizer
    padding_side = "right"; pad_token_id = 0; model_input_names = ["input_ids", "attention_mask"]
    def save_pretrained(self, path, **kw): pass
    def pad(self, features, padding=True, max_length=None, pad_to_multiple_of=None, return_tensors="pt"):
        L = max(len(f["input_ids"]) for f in features)
        out = {"input_ids": torch.tensor([f["input_ids"] + [0] * (L - len(f["input_ids"])) for f in features]),
               "attention_mask": torch.tensor([f["attention_mask"] + [0] * (L - len(f["attention_mask"])) for f in features]),
               "labels": torch.tensor([f["labels"] for f in features])}
        return out

def in_shared_memory(t):
    """Whether ``t``'s memory lies in one of shmloader's shared mappings (ring or overflow)."""
    ptr = t.untyped_storage().data_ptr()
    for line in open("/proc/self/maps"):
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= ptr < hi:
            return len(parts) > 5 and "shmloader" in parts[5]
    return False

def main():
    out, max_steps, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "resume"
    shmloader.install()
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, max_position_embeddings=64))
    seen, ring = [], []
    class T(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            seen.append(inputs["input_ids"].tolist())
            ring.append(in_shared_memory(inputs["input_ids"]))
            return super().compute_loss(model, inputs, return_outputs=return_outputs, **kw)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, max_steps=max_steps, save_steps=5, save_strategy="steps",
                             dataloader_num_workers=2, report_to=[], use_cpu=True, logging_steps=1, seed=0, learning_rate=5e-3, disable_tqdm=True)
    trainer = T(model=model, args=args, train_dataset=Sentences(), data_collator=DataCollatorWithPadding(Tok()))
    trainer.train(resume_from_checkpoint=resume or None)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    json.dump({"seen": seen, "losses": losses, "ring": ring}, open(pathlib.Path(out) / "report.json", "w"))
    print("batches", len(seen), "through the ring", sum(ring))

if __name__ == "__main__":
    main()

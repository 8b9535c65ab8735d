"""A ``transformers.Trainer`` / TRL ``SFTTrainer`` script with nothing of shardbridge in it (``test_trainer.py``).

The same file runs in one process (``python trainer_script.py OUT ...``, the oracle) and under
``shardbridge launch --config_file FILE trainer_script.py OUT ...``: the launcher's plugin makes
the Trainer's ``accelerate.Accelerator`` shardbridge's. Tiny models from configs, data built in
code (random tokens for the Trainer; a chat dataset and a character-level tokenizer for
SFTTrainer), no downloads. Rank 0 writes::

    OUT/log.json        trainer.state.log_history (per-step loss, grad_norm, learning_rate, eval_loss)
    OUT/grads.pt        every parameter's gradient at the first optimizer step (full tensors,
                        accumulated over the micro-batches and clipped, before the update)
    OUT/model/          trainer.save_model()
    OUT/checkpoint-N/   the Trainer's checkpoints (save_steps=2)

``--then-resume K`` (launched runs): afterwards a second Trainer, built from scratch in the same
processes, resumes from ``OUT/checkpoint-K`` into ``OUT/resumed/`` (same files): an interrupted
run in the same launch. ``--eval-first`` runs ``trainer.evaluate()`` before training.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

SEQ, VOCAB, EVAL_ROWS = 16, 256, 16


class FirstStepGrads(TrainerCallback):
    """Saves the gradients the first optimizer step applies (the test's only hook; the Trainer is unchanged)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step != 0:
            return
        grads = {}
        for name, param in model.named_parameters():
            if param.grad is not None:
                grad = param.grad
                grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad  # every rank joins
                grads[name] = grad.detach().cpu().clone()
        if args.process_index == 0:
            torch.save(grads, self.path)


def tiny_model(arch: str, vocab: int):
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        cfg = Qwen3MoeConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=4, head_dim=8, num_experts=4, num_experts_per_tok=2,
        )  # fmt: skip
    else:
        from transformers import LlamaConfig

        cfg = LlamaConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def token_data():
    g = torch.Generator().manual_seed(0)
    rows = lambda n: [{"input_ids": t, "labels": t} for t in torch.randint(0, VOCAB, (n, SEQ), generator=g)]  # noqa: E731
    return rows(64), rows(EVAL_ROWS)


def chat_tokenizer():
    """A character-level tokenizer with a chat template, built in code."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return tokenizer


def chat_data():
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)

    def rows(n):
        pairs = torch.randint(0, 50, (n, 2), generator=g).tolist()
        return Dataset.from_list(
            [{"messages": [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": str(a + b)}]}
             for a, b in pairs]
        )  # fmt: skip

    return rows(64), rows(EVAL_ROWS)


def build_trainer(opts, out: str):
    common = dict(
        output_dir=out, max_steps=opts.steps, per_device_train_batch_size=opts.batch, per_device_eval_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2,
        max_grad_norm=0.5, logging_steps=1, save_steps=2, eval_strategy="steps", eval_steps=2, report_to="none",
        seed=0, disable_tqdm=True,
    )  # fmt: skip
    if opts.trainer == "sft":
        from trl import SFTConfig, SFTTrainer

        tokenizer = chat_tokenizer()
        train, evals = chat_data()
        args = SFTConfig(**common, max_length=32, bf16=False)
        model = tiny_model(opts.arch, len(tokenizer))
        return SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=evals, processing_class=tokenizer)
    train, evals = token_data()
    model = tiny_model(opts.arch, VOCAB)
    return Trainer(model=model, args=TrainingArguments(**common), train_dataset=train, eval_dataset=evals)


def run(opts, out: str, resume_from: str | None) -> None:
    trainer = build_trainer(opts, out)
    trainer.add_callback(FirstStepGrads(os.path.join(out, "grads.pt")))
    if opts.eval_first:
        trainer.evaluate()
    trainer.train(resume_from_checkpoint=resume_from)
    trainer.save_model(os.path.join(out, "model"))
    if trainer.is_world_process_zero():
        with open(os.path.join(out, "log.json"), "w") as f:
            json.dump(trainer.state.log_history, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--trainer", choices=("trainer", "sft"), default="trainer")
    parser.add_argument("--arch", choices=("llama", "qwen3_moe"), default="llama")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="per_device_train_batch_size")
    parser.add_argument("--eval-first", action="store_true")
    parser.add_argument("--then-resume", type=int, default=None, metavar="K")
    opts = parser.parse_args()
    run(opts, opts.out, None)
    if opts.then_resume is not None:
        run(opts, os.path.join(opts.out, "resumed"), os.path.join(opts.out, f"checkpoint-{opts.then_resume}"))


if __name__ == "__main__":
    main()

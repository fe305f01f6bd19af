"""A small character-level Transformer language model trained on the Python standard library's own
source files: text that exists on every machine with Python, no download needed."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import nn

from cluster import Task, TensorBatchDataset

# Modules present in every CPython 3.x; read in this order so the corpus is fixed for a Python version.
CORPUS_FILES = [
    "functools.py",
    "collections/__init__.py",
    "inspect.py",
    "argparse.py",
    "textwrap.py",
    "dataclasses.py",
    "typing.py",
    "pathlib.py",
    "shutil.py",
    "subprocess.py",
    "json/encoder.py",
    "json/decoder.py",
    "string.py",
    "random.py",
    "statistics.py",
    "heapq.py",
    "bisect.py",
    "csv.py",
]


def load_corpus(max_chars: int) -> bytes:
    root = os.path.dirname(os.__file__)
    parts = []
    total = 0
    for rel in CORPUS_FILES:
        path = os.path.join(root, rel)
        if not os.path.exists(path):
            continue
        with open(path, "rb") as fh:
            data = fh.read()
        parts.append(data)
        total += len(data)
        if total >= max_chars:
            break
    return b"".join(parts)[:max_chars]


class CharTransformer(nn.Module):
    def __init__(
        self, vocab: int, context: int, d_model: int, n_layers: int, n_heads: int, dropout: float
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, 4 * d_model, dropout, batch_first=True, norm_first=True, activation="gelu"
        )
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask: torch.Tensor = self.mask  # type: ignore[assignment]  # a registered buffer
        x = self.blocks(x, mask=mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))


class CharLMTask(Task):
    """task_args: context (64), d_model (64), n_layers (2), n_heads (4), dropout (0.0), max_chars (300000),
    lr (3e-3), warmup_steps (20), optimizer ("adamw" or "sgd"), eval_chars (0: no eval set; else the
    corpus text right after the training text, held out and evaluated at ``evaluation.*``)."""

    def __init__(self, **args: Any) -> None:
        super().__init__(**args)
        self.context = int(args.get("context", 64))
        self.max_chars = int(args.get("max_chars", 300_000))
        self.eval_chars = int(args.get("eval_chars", 0))

    def build_model(self) -> nn.Module:
        a = self.args
        return CharTransformer(
            256,
            self.context,
            int(a.get("d_model", 64)),
            int(a.get("n_layers", 2)),
            int(a.get("n_heads", 4)),
            float(a.get("dropout", 0.0)),
        )

    def build_train_dataset(self) -> TensorBatchDataset:
        return self._sequences(load_corpus(self.max_chars))

    def build_eval_dataset(self) -> TensorBatchDataset | None:
        if self.eval_chars <= 0:
            return None
        held_out = load_corpus(self.max_chars + self.eval_chars)[self.max_chars :]
        if len(held_out) <= self.context:
            raise ValueError(
                f"eval_chars={self.eval_chars}: the corpus has {len(held_out)} characters after the "
                f"first max_chars={self.max_chars}, fewer than one sequence of {self.context + 1}"
            )
        return self._sequences(held_out)

    def _sequences(self, text: bytes) -> TensorBatchDataset:
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        n = (len(data) - 1) // self.context
        x = data[: n * self.context].view(n, self.context)
        y = data[1 : n * self.context + 1].view(n, self.context)
        return TensorBatchDataset(x, y)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        lr = float(self.args.get("lr", 3e-3))
        if self.args.get("optimizer", "adamw") == "sgd":
            return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    def build_scheduler(
        self, optimizer: torch.optim.Optimizer, total_steps: int
    ) -> torch.optim.lr_scheduler.LRScheduler:
        warmup = max(1, int(self.args.get("warmup_steps", 20)))
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))

    def compute_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        x, y = batch
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        return loss, {}

    def compute_eval(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        x, y = batch
        logits = model(x).float()
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        acc = (logits.argmax(-1) == y).double().mean()
        return loss, {"bits_per_char": loss.double() / math.log(2), "acc": acc}

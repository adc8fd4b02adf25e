"""Runtimes that turn token windows into logits: transformers (float, from a folder) here; llama.cpp lives in its
backend. All return float32 logits [tokens, vocab] for one window, so evaluation code treats them alike."""

from __future__ import annotations

from pathlib import Path

import numpy as np


class TorchRunner:
    runtime = "transformers"

    def __init__(self, model, threads: int):
        import torch

        torch.set_num_threads(max(1, threads))
        self.model = model.eval()

    @classmethod
    def from_folder(cls, folder: Path, *, threads: int, trust_remote_code: bool = False) -> "TorchRunner":
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, trust_remote_code=trust_remote_code, use_safetensors=True
        )
        return cls(model, threads)

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        import torch

        with torch.inference_mode():
            ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64)[None, :])
            return self.model(input_ids=ids).logits[0].float().numpy()

    def close(self) -> None:
        self.model = None

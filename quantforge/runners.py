"""Runtimes that turn token windows into logits: transformers (float, from a folder) here; llama.cpp lives in its
backend. All return float32 logits [tokens, vocab] for one window, so evaluation code treats them alike."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np


class TorchRunner:
    runtime = "transformers"

    def __init__(self, model, threads: int):
        import torch

        torch.set_num_threads(max(1, threads))
        self.model = model.eval()
        # Where the inputs go: the first tensor not resting on meta (lean models keep some weights there).
        tensors = itertools.chain(model.parameters(), model.buffers())
        self.device = next((t.device for t in tensors if t.device.type != "meta"), torch.device("cpu"))

    @classmethod
    def from_folder(
        cls, folder: Path, *, threads: int, device: str = "cpu", trust_remote_code: bool = False
    ) -> "TorchRunner":
        """The checkpoint computing in float32, its weights held in their stored dtype (see ``lean``)."""
        from .lean import stored_dtype_model

        model = stored_dtype_model(folder, device=device, trust_remote_code=trust_remote_code)
        return cls(model, threads)

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        import torch

        with torch.inference_mode():
            ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64)[None, :], device=self.device)
            # No KV cache: nothing decodes after the window, and it would be held beside the window's logits at the
            # forward's peak (about 0.5 GB at 2048 positions for an 8B model with grouped-query attention).
            return self.model(input_ids=ids, use_cache=False).logits[0].float().cpu().numpy()

    def close(self) -> None:
        from .memory import release_freed_memory

        self.model = None
        release_freed_memory()

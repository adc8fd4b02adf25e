"""Runtimes that turn token windows into logits: transformers (float, from a folder) here; llama.cpp lives in its
backend. All return float32 logits [tokens, vocab] for one window, so evaluation code treats them alike."""

from __future__ import annotations

import inspect
import itertools
from pathlib import Path

import numpy as np

HEAD_ROWS = 128  # positions whose logits exist at a time when a window is scored (``TorchRunner.scored_logits``)


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
            ids = self._ids(tokens)
            # No KV cache: nothing decodes after the window, and it would be held beside the window's logits at the
            # forward's peak (about 0.5 GB at 2048 positions for an 8B model with grouped-query attention).
            return self.model(input_ids=ids, use_cache=False).logits[0].float().cpu().numpy()

    def last_logits(self, tokens: np.ndarray, rows: int) -> np.ndarray:
        """The logits of the window's last ``rows`` positions (a task's continuation): the model's head runs on
        those alone where its forward takes ``logits_to_keep``."""
        import torch

        if "logits_to_keep" not in inspect.signature(self.model.forward).parameters:
            return self.logits(tokens)[-rows:]
        with torch.inference_mode():
            logits = self.model(input_ids=self._ids(tokens), use_cache=False, logits_to_keep=rows).logits[0]
        return logits.float().cpu().numpy()

    def _ids(self, tokens: np.ndarray):
        """One window's token ids as the batch of one the model takes, on its device."""
        import torch

        return torch.as_tensor(np.asarray(tokens, dtype=np.int64)[None, :], device=self.device)

    def scored_logits(self, tokens: np.ndarray, first: int = 0):
        """The logits of a window's scored positions (``first`` to the last but one), ``HEAD_ROWS`` positions at a
        time; the head runs on those positions alone.

        The body runs once over the window; the model's own forward then runs the head (and whatever it does after
        the head: soft-capping, scaling) on one block of the body's output at a time, its body standing in with
        that block. A window's logits are never whole in memory: at SmolLM2's 49k vocabulary and 512 positions they
        were 100 MB, a quarter of the 135M reference's memory beyond its weights; at 152k and 2048 positions, 1.2 GB.
        On this project's AMD EPYC hosts the head's product is bit for bit the whole window's at blocks of 16 to 256
        rows (all eight test architectures); an earlier AVX-512 host's MKL differed at float32 rounding for some
        block sizes, far inside every figure's noise. Each block widens a lean LM head again (a 135M model: under
        0.1 s a window). A forward without ``logits_to_keep`` (older remote code) gets its whole logits, as before.
        """
        import torch

        body = getattr(self.model, "base_model", None)
        if (
            body is None
            or body is self.model
            or "logits_to_keep" not in inspect.signature(self.model.forward).parameters
        ):
            yield self.logits(tokens)[first:-1]
            return
        ids = self._ids(tokens)
        with torch.inference_mode():
            outputs = body(input_ids=ids, use_cache=False)
        hidden, scored = outputs.last_hidden_state, len(tokens) - 1
        for start in range(first, scored, HEAD_ROWS):
            block = slice(start, min(start + HEAD_ROWS, scored))
            yield self._head(body, ids[:, block], type(outputs)(last_hidden_state=hidden[:, block]))

    def _head(self, body, ids, block_output) -> np.ndarray:
        """The model's forward on ``ids`` with its body answering ``block_output``: the head's logits for those rows."""
        import torch

        body.forward = lambda *args, **kwargs: block_output  # an instance attribute, removed below
        try:
            with torch.inference_mode():
                logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=0).logits[0]
        finally:
            del body.forward
        return logits.float().cpu().numpy()

    def close(self) -> None:
        from .memory import release_freed_memory

        self.model = None
        release_freed_memory()

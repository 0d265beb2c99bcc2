"""The pooler: what a pooling model's runner calls on a step's hidden states, in place of the
sampler (vLLM's `Pooler`: a pooling method, then a head per task).

A step holds chunks of prompts: request i's `counts[i]` tokens from position `computed[i]`
on, back to back in `hidden` ([num_tokens, hidden_size]). A request's result is ready in the
step that reaches its prompt's end. Methods that read more than the last position (MEAN, CLS,
ALL) keep what earlier chunks contributed per request handle; a chunk at position 0 starts
over (a new request, or one preempted and recomputed).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from protocol.pooling_params import PoolingParams

Classifier = Callable[[torch.Tensor], torch.Tensor]  # [n, hidden] float32 -> [n, labels]


class PoolerStateError(RuntimeError):
    """A chunk continues a request whose earlier chunks this pooler never saw."""


class Pooler:
    """`pooling_type` (LAST, MEAN, CLS) pools the sequence tasks (embed, classify); the
    per-token tasks (token_embed, token_classify) keep every row (ALL). `classifier` is the
    model's score head (classify models), None for embedding models."""

    def __init__(self, pooling_type: str, classifier: Classifier | None) -> None:
        self.pooling_type = pooling_type
        self.classifier = classifier
        # handle -> what earlier chunks contributed: a MEAN sum [hidden] (float32), the CLS
        # row, or the ALL rows so far (a list of [rows, hidden] tensors).
        self.partial: dict[int, torch.Tensor | list[torch.Tensor]] = {}

    def forget(self, handles: Sequence[int]) -> None:
        for handle in handles:
            self.partial.pop(handle, None)

    def rows_needed(self, counts: np.ndarray, done: np.ndarray,
                    params: list[PoolingParams]) -> np.ndarray | None:
        """The token rows whose final hidden states this step's pooling reads, when that is
        one row per finishing request (LAST, no per-token task): each one's last row, in
        request order. None: every row is read (or none is: nothing finishes)."""
        if self.pooling_type != "LAST" or not done.any() or any(p.per_token for p in params):
            return None
        return (np.cumsum(counts) - 1)[done]

    def __call__(self, hidden: torch.Tensor, handles: list[int], counts: np.ndarray,
                 computed: np.ndarray, prompt_lens: np.ndarray, done: np.ndarray,
                 params: list[PoolingParams], selected: bool = False) -> list[bytes | None]:
        """Results in request order: float32 little-endian bytes for requests whose prompt
        ends in this step (`done`), None for the others. `params[i]` is request i's.
        `selected`: `hidden` holds only the `rows_needed` rows, not every token's."""
        ends = np.cumsum(counts)
        starts = ends - counts
        per_token = np.array([p.per_token for p in params], bool)
        if selected:
            rows = np.flatnonzero(done)
            pooled = dict(zip(rows.tolist(), hidden.float()))
        else:
            pooled = self._pool_sequences(hidden, handles, starts, ends, computed,
                                          prompt_lens, ~per_token, done)
        results: list[bytes | None] = [None] * len(handles)
        groups: dict[tuple, list[int]] = {}  # requests whose heads run as one batch
        for i in pooled:
            p = params[i]
            groups.setdefault((p.task, p.dimensions, p.activation), []).append(i)
        for indices in groups.values():
            out = self._head(torch.stack([pooled[i] for i in indices]), params[indices[0]])
            for i, row in zip(indices, out):
                results[i] = _to_bytes(row)
        for i in np.flatnonzero(per_token).tolist():
            rows = self._pool_all(hidden, handles[i], starts[i], ends[i], computed[i], done[i])
            if rows is not None:
                results[i] = _to_bytes(self._head(rows, params[i]))
        return results

    # --- methods ---------------------------------------------------------------------------

    def _pool_sequences(self, hidden: torch.Tensor, handles: list[int], starts: np.ndarray,
                        ends: np.ndarray, computed: np.ndarray, prompt_lens: np.ndarray,
                        sequence: np.ndarray, done: np.ndarray) -> dict[int, torch.Tensor]:
        """request index -> its pooled [hidden] float32 vector, for the `sequence`-task
        requests whose prompt ends here; earlier chunks' parts are kept for the others
        (except with LAST, which needs none)."""
        wanted = sequence & done
        if self.pooling_type == "LAST":
            rows = np.flatnonzero(wanted)
            if not len(rows):
                return {}
            last = hidden[torch.from_numpy(ends[rows] - 1)].float()
            return dict(zip(rows.tolist(), last))
        whole = wanted & (computed == 0)  # the whole prompt in this step: no state
        chunked = sequence & ~whole
        if self.pooling_type == "CLS":
            firsts = hidden[torch.from_numpy(starts)].float()
            return self._combine(firsts, handles, computed, wanted, whole, chunked, True)
        sums = torch.zeros(len(handles), hidden.shape[1], dtype=torch.float32)
        segment = torch.from_numpy(np.repeat(np.arange(len(handles)), ends - starts))
        sums.index_add_(0, segment, hidden.float())
        totals = self._combine(sums, handles, computed, wanted, whole, chunked, False)
        return {i: total / float(prompt_lens[i]) for i, total in totals.items()}

    def _combine(self, parts: torch.Tensor, handles: list[int], computed: np.ndarray,
                 wanted: np.ndarray, whole: np.ndarray, chunked: np.ndarray, keep_first: bool,
                 ) -> dict[int, torch.Tensor]:
        """Merge this step's per-request `parts` with earlier chunks': the first chunk's
        (CLS) or their sum (MEAN). Returns the merged value of the `wanted` requests and
        keeps it for the `chunked` ones that go on."""
        merged: dict[int, torch.Tensor] = {i: parts[i] for i in np.flatnonzero(whole).tolist()}
        for i in np.flatnonzero(chunked).tolist():
            handle = handles[i]
            if computed[i] == 0:
                value = parts[i].clone()
            else:
                earlier = self.partial.pop(handle, None)
                if earlier is None:
                    raise PoolerStateError(f"request handle {handle} continues at position "
                                           f"{computed[i]} but its earlier chunks were not "
                                           "pooled here")
                value = earlier if keep_first else earlier + parts[i]
            if wanted[i]:
                merged[i] = value
            else:
                self.partial[handle] = value
        return merged

    def _pool_all(self, hidden: torch.Tensor, handle: int, start: int, end: int,
                  computed: int, done: bool) -> torch.Tensor | None:
        rows = hidden[start:end].float()
        earlier = [] if computed == 0 else self.partial.pop(handle, None)
        if earlier is None:
            raise PoolerStateError(f"request handle {handle} continues at position "
                                   f"{computed} but its earlier chunks were not pooled here")
        parts = [*earlier, rows]
        if not done:
            self.partial[handle] = parts
            return None
        return torch.cat(parts) if len(parts) > 1 else rows

    # --- heads -----------------------------------------------------------------------------

    def _head(self, pooled: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """[n, hidden] float32 -> the task's [n, d] result (n = 1 for a sequence task);
        no task means the model's own."""
        if params.task in ("classify", "token_classify") or (
                params.task is None and self.classifier is not None):
            if self.classifier is None:
                raise PoolerStateError(f"task {params.task} needs a classification model")
            logits = self.classifier(pooled)
            if not params.activation:
                return logits
            return torch.sigmoid(logits) if logits.shape[-1] < 2 else logits.softmax(-1)
        if params.dimensions is not None:
            pooled = pooled[:, :params.dimensions]
        return F.normalize(pooled, p=2, dim=-1) if params.activation else pooled


def _to_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().to(torch.float32).contiguous().numpy().astype("<f4",
                                                                         copy=False).tobytes()

"""Online adaptation of draft heads (Medusa, EAGLE-3): a head learns from the traffic it drafts for.

What it learns from. Verification has already computed, for every token the target read, the features the
head drafts from (EAGLE-3: the states entering its three layers; Medusa: the final hidden state), and the
committed tokens are the target's own (at temperature 0 its argmax; otherwise draws from its processed
distribution, whose expected cross-entropy is the soft one). A head drafts from a run of consecutive
positions (EAGLE's layer attends over all of them), so heads learn from windows of a sequence, not single
positions: each row logs its committed positions' features and tokens (`FeatureLog`) and hands a
`HeadWindow` to the drafter's `ExampleBuffer` every `AdaptConfig.head_window` positions whose next token the
target chose, and what is left (at least MIN_WINDOW of them) when the sequence leaves the batch. An EAGLE
window carries up to head_window positions before those as context (the prompt's, or ones an earlier
window learned from): the head learns with the context it drafts with, never the prompt's own tokens. `OnlineAdapter` drains that buffer as it
drains `AdaptationBuffer` for other drafters. So `learn_from`, `top_k`, `include_undrafted` and
`max_context` do not apply: heads learn from every committed position, and an example is a window.

Updates (`HeadTrainer`): a float32 master copy of the head and AdamW, EAGLE-3 with the training-time test
(`models.heads.eagle3_ttt`), Medusa with each head's soft cross-entropy at its distance (`MedusaHeads.soft_loss`);
the target's LM head rows of a tied Medusa head and the token embeddings stay frozen. The serving copy (in
the serving dtype, on the native kernels when the drafter uses them) is swapped in at the start of the next
`propose`, so a step never drafts with weights that change under it: the exactness argument is the draft
model's (`verispec.adapt`). EAGLE entries already in a row's cache stay as the old weights made them.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass

import torch

from verispec.config import AdaptConfig
from verispec.core.adaptation import ExampleBuffer
from verispec.drafters.draft_adapt import optimizer_steps
from verispec.models.heads.eagle3 import Eagle3Head
from verispec.models.heads.eagle3_ttt import Sample, training_batch, unrolled
from verispec.models.heads.medusa import MedusaHeads

MIN_WINDOW = 8  # positions: a shorter leftover of a finished sequence is not worth a window


@dataclass(frozen=True)
class HeadWindow:
    """T consecutive positions of one sequence; the head learns the tokens after positions labelled .. T - 1 (the
    ones before are context: the prompt's, or positions an earlier window learned from)."""

    position: int  # the first one's
    tokens: torch.Tensor  # (T + 1,) long: the tokens the target read at the T positions, then the one after the last
    features: torch.Tensor  # (T, F) float16: the target's features when it read each of them
    labelled: int  # the first position (index) whose next token the target chose


class FeatureLog:
    """One row's committed positions: up to `context` positions already learned from (or the prompt's), then the
    positions whose next token the target chose and no window has taken yet."""

    def __init__(self, window: int, context: int) -> None:
        self.window, self.context = window, context
        self.next: int | None = None  # the position of the next token the target reads
        self.start = 0  # the position of the first logged one
        self.labelled_from = 0  # the first position a window has not learned from (or the prompt's last: its
        # next token is the first the target chose)
        self.tokens: list[int] = []  # the tokens read at the logged positions, then the one after the last
        self.features: list[torch.Tensor] = []  # (n, F) chunks, one row per logged position

    @property
    def count(self) -> int:
        return len(self.tokens) - 1 if self.tokens else 0

    @property
    def labelled(self) -> int:
        """Logged positions whose next token a window can still learn."""
        return max(0, self.start + self.count - max(self.labelled_from, self.start))

    def add(self, tokens: list[int], prompt_len: int, features: torch.Tensor, finished: bool, out: ExampleBuffer) -> None:
        """features: (n, F) the target's features at the n positions it read last; tokens: the sequence after this
        step's commit. A step that did not finish the sequence committed the token after the last of them; one that
        finished it may have been cut short (EOS, a stop string, the length), so its positions follow the log's."""
        n = features.shape[0]
        first = len(tokens) - 1 - n
        if finished:
            if self.next is None:
                return
            first, n = self.next, max(0, min(n, len(tokens) - 1 - self.next))  # those with a committed token after
        elif first != self.next:  # a gap: what is logged cannot go on
            self.flush(out)
            self.tokens, self.features, self.start = ([tokens[first]] if first >= 0 else []), [], first
            self.labelled_from = max(first, prompt_len - 1)
        self.next = first + n
        if not self.tokens or not n:
            return
        self.tokens += tokens[first + 1 : first + 1 + n]
        self.features.append(features[:n].detach().to(torch.float16))
        while self.labelled >= self.window:
            self._cut(self.labelled_from + self.window, out)
        self._trim()

    def flush(self, out: ExampleBuffer) -> None:
        """Hand over what is logged if it has enough to learn, and start empty."""
        if self.labelled >= MIN_WINDOW:
            self._cut(self.start + self.count, out)
        self.tokens, self.features = [], []

    def _cut(self, end: int, out: ExampleBuffer) -> None:
        """Hand over positions start .. end - 1, learning from labelled_from on; keep the rest."""
        features = torch.cat(self.features)  # (count, F)
        size, labelled = end - self.start, max(0, self.labelled_from - self.start)
        out.add([HeadWindow(self.start, torch.tensor(self.tokens[: size + 1], dtype=torch.long), features[:size].clone(),
                            labelled)])
        self.features, self.labelled_from = [features], end
        self._trim()

    def _trim(self) -> None:
        """Drop positions before the labelled ones beyond `context` of them."""
        drop = max(self.labelled_from, self.start) - self.context - self.start
        if drop > 0 and self.tokens:
            features = torch.cat(self.features)
            self.tokens, self.features, self.start = self.tokens[drop:], [features[drop:]], self.start + drop


class HeadAdaptation:
    """A head drafter's side of online adaptation: the rows' logs, the buffer, the trainer, the pending head.

    Args:
        config: adaptation settings.
        trainer: makes the `HeadTrainer` on the first update (it copies the head then).
        context: positions before a window's labelled ones that it carries (EAGLE's layer attends to them).
    """

    def __init__(self, config: AdaptConfig, trainer, context: int = 0) -> None:
        self.config, self.context = config, context
        self.buffer = ExampleBuffer(max(1, config.buffer_size // config.head_window))
        self.logs: list[FeatureLog] = []
        self._make_trainer, self.trainer = trainer, None
        self._pending = None
        self._lock = threading.Lock()

    def rows(self, count: int, add: bool = False) -> None:
        """start (add=False) or extend the batch by `count` rows."""
        if not add:
            for log in self.logs:
                log.flush(self.buffer)
            self.logs = []
        self.logs += [FeatureLog(self.config.head_window, self.context) for _ in range(count)]

    def keep(self, rows: list[int]) -> None:
        kept = set(rows)
        for r, log in enumerate(self.logs):
            if r not in kept:
                log.flush(self.buffer)
        self.logs = [self.logs[r] for r in rows]

    def log(self, sequences, features: list[torch.Tensor]) -> None:
        """features[b]: (n_b, F) the target's features at row b's newly committed positions, in order."""
        if not self.buffer.enabled:
            return
        for log, seq, f in zip(self.logs, sequences, features):
            if f.shape[0]:
                log.add(seq.tokens, seq.prompt_len, f, seq.finish_reason is not None, self.buffer)

    def adapt(self, windows: list[HeadWindow]) -> None:
        """Train on the windows now (any thread); the new head is taken by `take` at the next propose."""
        if self.trainer is None:
            self.trainer = self._make_trainer()
        head = self.trainer.train(windows)
        with self._lock:
            self._pending = head

    def take(self):
        """The head an update made since the last call, or None."""
        with self._lock:
            head, self._pending = self._pending, None
        return head


class AdaptiveHead:
    """What head drafters share for online adaptation: `adaptation` (a HeadAdaptation once `check_adaptable` ran)
    and the attribute holding the head they draft with (`head_attribute`), which `_swap` replaces."""

    adaptation: HeadAdaptation | None = None  # (its drafters' traits say adaptive)
    head_attribute = "head"

    def adaptation_buffer(self) -> ExampleBuffer:
        return self.adaptation.buffer

    def adapt(self, examples: list) -> None:
        """Train a copy of the head on logged windows now (any thread); it drafts from the next step on."""
        self.adaptation.adapt(examples)

    def _swap(self) -> None:
        """At the start of a step: draft with the head an update made, if one did."""
        head = self.adaptation.take() if self.adaptation is not None else None
        if head is not None:
            setattr(self, self.head_attribute, head)

    def _rows_started(self, count: int, add: bool = False) -> None:
        if self.adaptation is not None:
            self.adaptation.rows(count, add)

    def _rows_kept(self, rows: list[int]) -> None:
        if self.adaptation is not None:
            self.adaptation.keep(rows)


class HeadTrainer:
    """The float32 master copy of a head, its optimizer and its loss over windows.

    Args:
        head: the head as loaded (torch modules: not the native-kernel copy).
        loss: (master, windows) -> scalar loss.
        serve: master copy -> the head to draft with (serving dtype, native linears where used).
        config: learning rate, batch size (windows per optimizer step), epochs and step limit.
        frozen: names (prefixes) of the parameters that stay as they are.
    """

    def __init__(self, head: torch.nn.Module, loss, serve, config: AdaptConfig, frozen: tuple[str, ...] = ()) -> None:
        self.master = copy.deepcopy(head).float().train()
        params = []
        for name, p in self.master.named_parameters():
            p.requires_grad_(not name.startswith(frozen) if frozen else True)
            if p.requires_grad:
                params.append(p)
        self.params, self.loss, self.serve, self.config = params, loss, serve, config
        self.lr = config.head_lr()
        self.optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0)
        self.steps = 0
        self.last_loss: float | None = None
        self._shuffle = torch.Generator().manual_seed(0)  # the order windows are visited in; never a sequence's

    def train(self, windows: list[HeadWindow]):
        steps, last = optimizer_steps(windows, lambda batch: self.loss(self.master, batch), self.params, self.optimizer,
                                      self.config, self._shuffle)
        self.last_loss = last if last is not None else self.last_loss
        self.steps += steps
        with torch.no_grad():
            serving = copy.deepcopy(self.master).eval()
            for p in serving.parameters():
                p.requires_grad_(False)
            return self.serve(serving)


def eagle_loss(embed, ttt: int = 3):
    """The training-time test over windows, labels the committed tokens (one-hot); embed: ids -> (n, E) rows."""

    def loss(head: Eagle3Head, windows: list[HeadWindow]) -> torch.Tensor:
        samples = []
        for w in windows:
            T = w.features.shape[0]
            samples.append(Sample(w.tokens[:T], w.features, w.tokens[1 : T + 1, None], torch.ones(T, 1), w.labelled))
        with torch.no_grad():
            batch = training_batch(samples, head, embed, ttt)
        return unrolled(head, *batch, ttt)[0]

    return loss


def medusa_loss(rows: torch.Tensor | None):
    """Each head's soft cross-entropy at its distance, labels the committed tokens; rows: (R, E) the target's LM
    head rows of a tied head (ids past them are not counted)."""

    def loss(heads: MedusaHeads, windows: list[HeadWindow]) -> torch.Tensor:
        total = torch.zeros(())
        for k in range(heads.num_heads):
            h, ids = [], []
            for w in windows:  # the state after reading token t guesses token t + k + 2 (labelled t only)
                a, n = w.labelled, w.features.shape[0] - k - 1
                if n > a:
                    h.append(w.features[a:n])
                    ids.append(w.tokens[a + k + 2 : k + 2 + n])
            if not h:
                continue
            h, ids = torch.cat(h).float(), torch.cat(ids)
            if rows is not None:
                keep = ids < rows.shape[0]
                h, ids = h[keep], ids[keep]
            if ids.numel():
                total = total + heads.soft_loss(k, h, ids[:, None], torch.ones(ids.numel(), 1), rows)
        return total

    return loss

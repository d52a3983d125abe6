"""Continuous batching: many generations decoded together, one token per row per forward, each row at its own
position, a row joining between two steps and leaving the step it finishes (what `litqlora serve` runs).

A row computes what `lit_qlora.model.sampling.generate` computes alone with the same settings and seed: it samples
from its own generator and stops at a stop id (not yielded) or after its `limit` tokens; only the order of
floating-point sums differs (rows batched together, a prompt fed in parts), so in float32 its tokens are generate's
(tests), and in bf16 a near tie may break the other way. The prompts that join between two steps are prefilled
together at the next one (all but their last token, one padded forward, after any prefix a recent prompt already
computed: `Prefixes`); each prompt's last token then goes through the decode forward with the other rows, so a
joining request costs no forward of its own.

The rows share one KV cache, `rows x length` per block, grown by doubling as rows join or lengthen; a row's keys and
values live in its cache row, and the live rows are always the first ones (one that leaves is replaced by the last),
so a step runs the first `len(rows)` cache rows over the longest row's length, each row's mask hiding the positions
beyond its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from lit_qlora.base.errors import InvalidInput
from lit_qlora.model import decode_step
from lit_qlora.model.decode_step import DecodeStep
from lit_qlora.model.sampling import sample
from lit_qlora.model.transformer import CacheView, Transformer


@dataclass
class Row:
    """One generation in the batch: what it was asked for and where it stands."""

    key: Any
    """The caller's name for it (a request's id)."""
    prompt: Sequence[int]
    limit: int
    """The most tokens it may generate."""
    temperature: float = 0.0
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stop_ids: frozenset = frozenset()
    seed: int = 1234
    adapter: int = 0
    """Which of the model's adapters it decodes with (`lit_qlora.lora.bank`); 0: the model as loaded."""
    generated: int = 0
    logits: Optional[torch.Tensor] = field(default=None, repr=False)
    """The next token's logits (vocab,), from the last step (None until its prompt has been fed)."""
    fed: int = 0
    """Positions whose keys and values are in its cache row."""
    feed: list = field(default_factory=list, repr=False)
    """Tokens to feed at the next step: its prompt's rest when it joins, then each token it draws."""
    generator: Optional[torch.Generator] = field(default=None, repr=False)
    reused: int = 0
    """Prompt positions whose keys and values came from a recent prompt's prefill (`Prefixes`)."""


@dataclass
class Token:
    """What a step gives for one row: its new token (None when it stopped at a stop id) and, on its last step, why it
    ended ("stop": a stop id; "length": its limit)."""

    key: Any
    token: Optional[int]
    finish: Optional[str] = None


class DecodeBatch:
    """The rows decoding together on `model` (module doc). `add` a row, then `step` until `rows` is empty; `drop` one
    whose caller went away. `before_forward(rows)`, when given, runs before each forward with the rows it computes
    (one row for a prefill): how per-row adapters are chosen."""

    def __init__(self, model: Transformer, before_forward: Optional[Callable[[list[Row]], None]] = None,
                 prefix_bytes: int = 256 << 20, min_reuse: int = 16) -> None:
        self.model = model
        self.rows: list[Row] = []
        self.before_forward = before_forward
        self.views: list[CacheView] = []
        self.capacity = (0, 0)  # (rows, positions) of the cache
        self.prefixes = Prefixes(prefix_bytes, min_reuse)
        self._step: Optional[DecodeStep] = None  # the C decode step over this cache, where it applies
        self._step_key: Any = None

    @property
    def device(self) -> torch.device:
        return self.model.model.embed_tokens.weight.device

    @torch.inference_mode()
    def add(self, row: Row) -> None:
        """Join `row`: its prompt is fed at the next `step` (its first token comes out of the step after)."""
        context = self.model.config.max_seq_length
        if not row.prompt or len(row.prompt) + row.limit > context:
            raise InvalidInput(f"A prompt of {len(row.prompt)} tokens and {row.limit} new ones do not fit the "
                               f"model's context ({context} tokens).")
        if row.limit < 1:
            raise InvalidInput(f"A row must be allowed at least one new token, not {row.limit}.")
        if row.generator is None:
            row.generator = torch.Generator(device=self.device).manual_seed(row.seed)
        self._reserve(len(self.rows) + 1, len(row.prompt))
        # A prompt that starts as a recent one did (a system prompt, an earlier turn) reuses those positions' keys
        # and values: only the rest goes through the model. Not across adapters: an adapter changes them.
        row.fed = self.prefixes.restore(row, self.views, len(self.rows))
        row.feed, row.logits = list(row.prompt[row.fed:]), None
        self.rows.append(row)

    @torch.inference_mode()
    def step(self) -> list[Token]:
        """Every row with logits draws its next token (a finished row leaves); then the prompts that joined are
        prefilled together (all but their last token), and one forward feeds every row its next token: a sampled
        one, or a new prompt's last."""
        out = []
        drawn = [row for row in self.rows if row.logits is not None]
        greedy = [row for row in drawn if row.temperature <= 0]  # one argmax for them all
        picks = dict(zip(map(id, greedy), torch.stack([r.logits for r in greedy]).float().argmax(-1).tolist()
                         if greedy else ()))
        for row in drawn:
            token = picks[id(row)] if id(row) in picks else sample(row.logits, row.temperature, row.top_k,
                                                                    row.generator, row.top_p)
            if token in row.stop_ids:
                out.append(Token(row.key, None, "stop"))
                continue
            row.generated += 1
            finished = row.generated >= row.limit
            out.append(Token(row.key, token, "length" if finished else None))
            row.feed = [token]
        for t in out:
            if t.finish:
                self.drop(t.key)
        self._prefill([row for row in self.rows if len(row.feed) > 1])
        if self.rows:
            self._forward()
        return out

    def drop(self, key: Any) -> None:
        """Take the row named `key` out (the last row moves into its cache row); nothing if there is none."""
        index = next((i for i, row in enumerate(self.rows) if row.key == key), None)
        if index is None:
            return
        last = len(self.rows) - 1
        if index != last:
            length = self.rows[last].fed
            with torch.inference_mode():
                for view in self.views:
                    view.whole_k[index, :, :length] = view.whole_k[last, :, :length]
                    view.whole_v[index, :, :length] = view.whole_v[last, :, :length]
            self.rows[index] = self.rows[last]
        self.rows.pop()
        if not self.rows:
            self.release()

    def release(self) -> None:
        """Free the cache (the next `add` allocates one again) and leave the model's blocks without one."""
        self.rows, self.views, self.capacity = [], [], (0, 0)
        self.model.clear_kv_cache()

    def _prefill(self, rows: list[Row]) -> None:
        """All but the last token of each row's prompt (what prefix reuse left), the rows as one padded forward.

        It runs over a cache of its own, `rows` x the longest, each row's reused prefix copied in; the keys and values
        computed go back to the rows' places in the batch's cache. Right padding continues each row's positions: a
        pad writes only past the row's real tokens (nothing copied back), and a real token never sees it. No head:
        each prompt's last token joins the next forward with the other rows."""
        if not rows:
            return
        index = {id(row): i for i, row in enumerate(self.rows)}
        width = max(len(row.feed) - 1 for row in rows)
        length = max(row.fed for row in rows) + width
        c = self.model.config
        temp = []
        for view in self.views:
            k = view.whole_k.new_zeros(len(rows), c.n_query_groups, length, c.head_dim)
            v = torch.zeros_like(k)
            for j, row in enumerate(rows):
                k[j, :, : row.fed] = view.whole_k[index[id(row)], :, : row.fed]
                v[j, :, : row.fed] = view.whole_v[index[id(row)], :, : row.fed]
            temp.append(CacheView(k, v))
        ids = torch.tensor([row.feed[:-1] + [row.feed[-2]] * (width - len(row.feed) + 1) for row in rows],
                           device=self.device)
        pos = torch.stack([torch.arange(row.fed, row.fed + width, device=self.device) for row in rows])
        for block, cache in zip(self.model.model.layers, temp):
            cache.select(slice(0, len(rows)), length)
            block.self_attn.kv_cache = cache
        self.model.max_cache_len = length
        if self.before_forward is not None:
            self.before_forward(rows)
        self.model.forward_hidden(ids, pos)
        for view, cache in zip(self.views, temp):
            for j, row in enumerate(rows):
                span = slice(row.fed, row.fed + len(row.feed) - 1)
                view.whole_k[index[id(row)], :, span] = cache.whole_k[j, :, span]
                view.whole_v[index[id(row)], :, span] = cache.whole_v[j, :, span]
        for row in rows:
            row.fed += len(row.feed) - 1
            row.feed = row.feed[-1:]
            self.prefixes.keep(row, self.views, index[id(row)])

    def _forward(self) -> None:
        """Each row's one token to feed, at its own position: every row's next logits."""
        rows = self.rows
        tokens = torch.tensor([row.feed for row in rows], device=self.device)
        pos = torch.tensor([[row.fed] for row in rows], device=self.device)
        length = max(row.fed for row in rows) + 1
        self._reserve(len(rows), length)
        self._select(slice(0, len(rows)), length)
        if self.before_forward is not None:
            self.before_forward(rows)
        step = self._decode_step()
        if step is not None:  # every block in one C call (model/decode_step.c), the first len(rows) cache rows
            logits = step(tokens[:, 0], pos[:, 0])
        else:
            logits = self.model.logits(self.model.forward_hidden(tokens, pos))[:, -1]
        for row, row_logits in zip(rows, logits):
            row.logits, row.feed = row_logits, []
            row.fed += 1

    def _decode_step(self) -> Optional[DecodeStep]:
        """The C decode step over this cache where it applies (an NF4 Llama-style model, its adapter a LoRALinear's
        or none), made again when the cache grows or a projection changes (an adapter bank loaded at runtime)."""
        model = self.model
        if self.device.type != "cpu":
            return None
        key = (id(self.views[0].whole_k), self.capacity,
               tuple(id(p) for block in model.model.layers for p in decode_step.projections(block)))
        if key != self._step_key:
            dtype = model.model.embed_tokens.weight.dtype
            caches = [(view.whole_k, view.whole_v) for view in self.views]
            self._step = DecodeStep(model, dtype, caches) if decode_step.applies(model, dtype, caches) else None
            self._step_key = key
        return self._step

    def _select(self, rows: slice, length: int) -> None:
        # (set on the blocks each time: another user of the model, a `generate`, may have put its own cache there)
        for block, view in zip(self.model.model.layers, self.views):
            view.select(rows, length)
            block.self_attn.kv_cache = view
        self.model.max_cache_len = length  # the masks' key length: the views'

    def _reserve(self, rows: int, length: int) -> None:
        """A cache of at least `rows` x `length` (doubling each that falls short, the kept rows copied over)."""
        have_rows, have_len = self.capacity
        if rows <= have_rows and length <= have_len:
            return
        new_rows, new_len = max(have_rows, 1), max(have_len, 64)
        while new_rows < rows:
            new_rows *= 2
        while new_len < length:
            new_len *= 2
        new_len = min(new_len, self.model.config.max_seq_length)
        c, ref = self.model.config, self.model.model.embed_tokens.weight
        dtype = ref.dtype if ref.dtype.is_floating_point else torch.bfloat16
        views, kept = [], len(self.rows)
        for i, block in enumerate(self.model.model.layers):
            k = torch.zeros(new_rows, c.n_query_groups, new_len, c.head_dim, device=self.device, dtype=dtype)
            v = torch.zeros_like(k)
            if self.views and kept:
                k[:kept, :, :have_len] = self.views[i].whole_k[:kept]
                v[:kept, :, :have_len] = self.views[i].whole_v[:kept]
            view = CacheView(k, v)
            block.self_attn.kv_cache = view
            views.append(view)
        self.views, self.capacity = views, (new_rows, new_len)


class Prefixes:
    """The keys and values of recent prompts, to start a new prompt from the longest one it begins with (a shared
    system prompt, a conversation's earlier turns): its prefill then computes only the positions after that.

    Kept per adapter (an adapter changes every key and value), most recent first, within `budget` bytes; a match
    shorter than `min_reuse` tokens is not worth the copy. The reused positions are the same computation done on
    fewer rows before: equal to a whole prefill up to the order of floating-point sums."""

    def __init__(self, budget: int, min_reuse: int) -> None:
        self.budget, self.min_reuse = budget, min_reuse
        # (adapter, prompt ids, each block's (k, v), their bytes), most recent first
        self.entries: list[tuple[int, tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]], int]] = []

    def restore(self, row: Row, views: list[CacheView], index: int) -> int:
        """Copy the longest matching prefix into cache row `index`; returns where the prefill starts."""
        best, found = 0, None
        for adapter, ids, kv, _ in self.entries:
            if adapter != row.adapter:
                continue
            n = _common(ids, row.prompt, len(row.prompt) - 1)  # at least the last position is computed: its logits
            if n > best:
                best, found = n, kv
        if found is None or best < self.min_reuse:
            return 0
        for view, (k, v) in zip(views, found):
            view.whole_k[index, :, :best] = k[:, :best]
            view.whole_v[index, :, :best] = v[:, :best]
        row.reused = best
        return best

    def forget(self, adapter: int) -> None:
        """Drop what was kept for `adapter` (its slot now holds another adapter, or none)."""
        self.entries = [e for e in self.entries if e[0] != adapter]

    def keep(self, row: Row, views: list[CacheView], index: int) -> None:
        """Remember the prompt positions row `index` has fed (the oldest entries make room)."""
        length = row.fed
        key = tuple(row.prompt[:length])
        self.entries = [e for e in self.entries if not (e[0] == row.adapter and e[1] == key)]
        size = sum(2 * view.whole_k[index, :, :length].numel() * view.whole_k.element_size() for view in views)
        if size > self.budget:
            return
        kv = [(view.whole_k[index, :, :length].clone(), view.whole_v[index, :, :length].clone()) for view in views]
        self.entries.insert(0, (row.adapter, key, kv, size))
        while sum(e[3] for e in self.entries) > self.budget:
            self.entries.pop()


def _common(a: Sequence[int], b: Sequence[int], most: int) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y or n >= most:
            break
        n += 1
    return n

"""The lm-eval model over a lit-qlora `Transformer`: `LitQLoRALM` (an `lm_eval.api.model.LM`).

Tokenization follows lm-eval's convention for causal models (the one its Hugging Face backend uses), so numbers
are comparable with `lm_eval --model hf` on the same checkpoint:

- loglikelihood(context, continuation): trailing whitespace of the context moves to the continuation; then
  context+continuation is encoded as one string and split after len(encode(context)) tokens. The word-boundary
  space therefore lands in the continuation's first token, as it would in running text (encoding the two
  parts separately would give the continuation a leading-space token the model never sees in practice).
  An empty context is replaced by one prefix token: BOS, or EOS when the tokenizer has none.
- BOS: contexts are encoded with the checkpoint's own rule (`Tokenizer.add_bos`, from tokenizer_config.json /
  tokenizer.json: Llama 2/3, Mistral and TinyLlama prepend BOS; SmolLM2 and Qwen2 do not), which is what a
  Hugging Face tokenizer does with its default add_special_tokens=True. A BOS is never doubled.
- loglikelihood_rolling(text): the text is encoded without BOS and scored conditioned on the prefix token, in
  windows of at most `max_length` inputs: every token is predicted exactly once, and the last window still
  gets a full context (lm-eval's `get_rolling_token_windows(..., context_len=1)` + `make_disjoint_window`).
- generate_until(context, gen_kwargs): the context is encoded like a loglikelihood context, left-truncated to
  leave room for `max_gen_toks`; decoding is greedy (temperature sampling only with do_sample=True) with the
  KV cache, and stops at EOS / end-of-turn tokens or at the first `until` string, which is cut off.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

import torch
from lm_eval.api.model import LM
from tqdm import tqdm

from lit_qlora.base.errors import InvalidInput
from lit_qlora.model.sampling import generate
from lit_qlora.model.transformer import Transformer
from lit_qlora.checkpoint.tokenizer import Tokenizer

HEAD_CHUNK = 1024
"""Output-head rows computed at once: bounds the float32 logits of long continuations (rolling windows)."""


Pair = tuple[list[int], list[int]]
Tree = tuple[list[int], list[int]]
"""A context and the requests (indices) scored as branches on it, in one row."""


def rolling_windows(tokens: Sequence[int], prefix_token: int, max_length: int) -> list[Pair]:
    """(context, continuation) token pairs that score every token of `tokens` exactly once, conditioned on
    `prefix_token` and as much preceding text as fits: continuation i is tokens[i*L:(i+1)*L], and its context is
    the L - len(continuation) + 1 tokens before it (the prefix token standing in front of the text)."""
    if max_length < 1:
        raise ValueError(f"max_length must be at least 1, got {max_length}")
    full = [prefix_token, *tokens]  # full[j + 1] is tokens[j]
    windows = []
    for start in range(0, len(tokens), max_length):
        end = min(start + max_length, len(tokens))
        windows.append((full[max(0, end - max_length):start + 1], list(tokens[start:end])))
    return windows


def _shared_prefix(contexts: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every context shares, each context's last token left out (it runs in its row)."""
    shared = 0
    while shared < min(len(c) for c in contexts) - 1 and len({c[shared] for c in contexts}) == 1:
        shared += 1
    return shared


def _tree_mask(shared: int, positions: torch.Tensor, branch: torch.Tensor, window: Optional[int],
               cache_len: int) -> torch.Tensor:
    """(rows, 1, tokens, cache_len) boolean attention mask of a tree batch: a token sees the `shared` prefix and the
    rest of its context (branch 0) and its own branch, up to its own position (within `window` positions of it,
    where given); the cache's slots past the batch's tokens are masked."""
    rows = positions.size(0)
    kv_pos = torch.cat([torch.arange(shared).expand(rows, -1), positions], 1)
    kv_branch = torch.cat([torch.zeros(rows, shared, dtype=torch.long), branch], 1)
    seen = ((kv_branch[:, None, :] == 0) | (kv_branch[:, None, :] == branch[:, :, None])) \
        & (kv_pos[:, None, :] <= positions[:, :, None])
    if window is not None:
        seen &= positions[:, :, None] - kv_pos[:, None, :] < window
    return torch.nn.functional.pad(seen[:, None], (0, cache_len - kv_pos.size(1)))


def first_stop(text: str, stops: Iterable[str]) -> Optional[int]:
    """Index of the earliest stop string in `text`, or None."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else None


class LitQLoRALM(LM):
    """An lm-eval model over a lit-qlora `Transformer` (plain, NF4, or NF4/plain base + LoRA adapter).

    Args:
        model: The model, already on its device and in eval mode.
        tokenizer: The checkpoint's tokenizer.
        batch_size: Sequences per forward pass in loglikelihood requests.
        max_length: Longest input in tokens (default: the model's context length); longer inputs are
            left-truncated.
        max_gen_toks: Default generation budget of generate_until when a task does not set one.
        share_context: Run a context shared by several requests (multiple-choice options) once.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer, batch_size: int = 8,
                 max_length: Optional[int] = None, max_gen_toks: int = 256, share_context: bool = True) -> None:
        super().__init__()
        if batch_size < 1:
            raise InvalidInput(f"--batch_size must be at least 1, got {batch_size}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length or model.config.max_seq_length
        self.max_gen_toks = max_gen_toks
        self.share_context = share_context
        self._device = next(model.parameters()).device
        prefix = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
        if prefix is None:
            raise InvalidInput(f"The tokenizer in {tokenizer.checkpoint_dir} has neither a BOS nor an EOS token; "
                               "lm-eval needs one to condition texts that have no context.")
        self.prefix_token_id: int = prefix
        self.pad_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0

    # -- tokenization ------------------------------------------------------------------------------------------
    def encode_pair(self, context: str, continuation: str) -> Pair:
        """(context tokens, continuation tokens) per lm-eval's convention (see the module docstring)."""
        stripped = context.rstrip()
        continuation = context[len(stripped):] + continuation
        if not stripped:
            tokens = self.tokenizer.encode(continuation, bos=False)
            if tokens[:1] == [self.prefix_token_id]:
                return tokens[:1], tokens[1:]
            return [self.prefix_token_id], tokens
        whole = self.tokenizer.encode(stripped + continuation)
        context_ids = self.tokenizer.encode(stripped)
        return context_ids, whole[len(context_ids):]

    # -- scoring -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def loglikelihood_tokens(self, pairs: Sequence[Pair], disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        """(sum of log p(continuation token), is every continuation token the argmax) per (context, continuation)
        pair, in the order given.

        Requests that share their context (the choices of a multiple-choice question) are scored as a tree: the
        context once, every continuation a branch on it (`_score_trees`). The others run in batches of
        `batch_size`, longest first (a batch that does not fit in memory fails at once), right-padded: under causal
        attention padding after a sequence cannot change its logits. Same numbers as running every sequence whole,
        up to float rounding; `share_context=False` runs every request whole.
        """
        results: list[Optional[tuple[float, bool]]] = [None] * len(pairs)
        plain: list[tuple[int, list[int], list[int]]] = []
        groups: dict[tuple[int, ...], list[int]] = {}
        trees = self.share_context and self._trees_apply()
        for i, (context, continuation) in enumerate(pairs):
            if not continuation:
                results[i] = (0.0, True)
                continue
            if not context:
                raise ValueError("a loglikelihood request needs at least one context token")
            if len(continuation) > self.max_length:
                raise InvalidInput(f"a continuation of {len(continuation)} tokens does not fit in max_length "
                                   f"{self.max_length} (the model's context): choose another task or model")
            tokens = (list(context) + list(continuation))[-(self.max_length + 1):]
            if trees and len(context) + len(continuation) <= self.max_length + 1:
                groups.setdefault(tuple(context), []).append(i)
            else:
                plain.append((i, tokens[:-1], list(continuation)))
        for context, members in list(groups.items()):
            if len(members) == 1:  # nothing shared: a plain sequence
                del groups[context]
                plain.append((members[0], [*context, *pairs[members[0]][1]][:-1], list(pairs[members[0]][1])))
        plain.sort(key=lambda item: -len(item[1]))  # stable: equal lengths keep request order
        batches = self._tree_batches(groups, pairs)
        steps = math.ceil(len(plain) / self.batch_size) + len(batches)
        with tqdm(total=steps, disable=disable_tqdm, desc="loglikelihood") as bar:
            for start in range(0, len(plain), self.batch_size):
                batch = plain[start:start + self.batch_size]
                x = self._right_padded([inputs for _, inputs, _ in batch])
                hidden = self.model.forward_hidden(x)
                # Only the positions that predict continuation tokens go through the head.
                selected = [hidden[row, len(inputs) - len(cont):len(inputs)]
                            for row, (_, inputs, cont) in enumerate(batch)]
                self._score(selected, [(i, cont) for i, _, cont in batch], results)
                bar.update()
            if batches:
                self._score_trees(batches, pairs, results, bar)
        return results  # type: ignore[return-value]

    def _right_padded(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        x = torch.full((len(rows), max(len(r) for r in rows)), self.pad_id, dtype=torch.long)
        for i, row in enumerate(rows):
            x[i, :len(row)] = torch.tensor(row)
        return x.to(self._device)

    def _score(self, hidden_rows: list[torch.Tensor], items: list[tuple[int, list[int]]],
               results: list) -> None:
        """Head + log-softmax (float32) over the hidden states that predict each item's continuation."""
        selected = torch.cat(hidden_rows)
        targets = torch.tensor([t for _, cont in items for t in cont], device=self._device)
        logprobs, greedy = [], []
        for h, t in zip(selected.split(HEAD_CHUNK), targets.split(HEAD_CHUNK)):  # bounds float32 logits
            logits = self.model.logits(h).float()
            logprobs.append(logits.log_softmax(-1).gather(-1, t[:, None]).squeeze(-1))
            greedy.append(logits.argmax(-1) == t)
        logprob, is_greedy = torch.cat(logprobs).double().cpu(), torch.cat(greedy).cpu()
        offset = 0
        for i, cont in items:
            n = len(cont)
            results[i] = (float(logprob[offset:offset + n].sum()), bool(is_greedy[offset:offset + n].all()))
            offset += n

    def _trees_apply(self) -> bool:
        """Whether requests sharing a context can be scored as a tree: every model but Phi-3's long RoPE, whose
        frequencies depend on the whole sequence's length (one row holding many branches has no single length)."""
        scaling = self.model.config.rope_scaling or {}
        return scaling.get("rope_type", scaling.get("type")) != "longrope"

    def _tree_batches(self, groups: dict[tuple[int, ...], list[int]], pairs: Sequence[Pair]) -> list[list[Tree]]:
        """The groups as rows (a group whose continuations do not fit `max_length` tokens is split), sorted by
        context so that a batch's rows share most of theirs, batched as many as keep a forward's tokens (rows x the
        widest row past the shared prefix) within what the whole-sequence path would run at once: `batch_size`
        times the batch's longest sequence, so the activations stay within the same bound."""
        rows: list[Tree] = []
        for context in sorted(groups):
            row: list[int] = []
            length = 1  # the context's last token
            for i in groups[context]:
                if row and length + len(pairs[i][1]) - 1 > self.max_length:
                    rows.append((list(context), row))
                    row, length = [], 1
                row.append(i)
                length += len(pairs[i][1]) - 1
            rows.append((list(context), row))
        def fits(batch: list[Tree]) -> bool:
            longest = max(len(c) + max(len(pairs[i][1]) for i in m) for c, m in batch)
            return self._tree_tokens(batch, pairs) <= self.batch_size * longest

        batches: list[list[Tree]] = []
        for row in rows:
            if batches and fits(batches[-1] + [row]):
                batches[-1].append(row)
            else:
                batches.append([row])
        return batches

    @staticmethod
    def _tree_tokens(batch: list[Tree], pairs: Sequence[Pair]) -> int:
        """A batch's forward tokens: its rows times the widest row past the prefix its contexts share."""
        shared = _shared_prefix([context for context, _ in batch])
        return len(batch) * max(len(c) - shared + sum(len(pairs[i][1]) - 1 for i in m) for c, m in batch)

    def _score_trees(self, batches: list[list[Tree]], pairs: Sequence[Pair], results: list, bar) -> None:
        """Each batch: the prefix its rows' contexts share (less their last token) into row 0 of the KV cache (only
        what row 0 does not hold already: a few-shot preamble runs once per call), copied to the other rows; then
        one forward of every row: the rest of its context, then each continuation (less its last token) as a branch
        that attends to the context and to itself only, at the positions it would have after the context alone.
        No padding among a question's choices; the hidden states that predict each continuation are the context's
        last one and its branch's."""
        model = self.model
        plans = [self._tree_plan(batch, pairs) for batch in batches]
        model.set_kv_cache(max(len(batch) for batch in batches), max(len(shared) + ids.size(1)
                                                                   for shared, ids, *_ in plans), device=self._device)
        caches = [block.self_attn.kv_cache for block in model.blocks]
        kinds = {block.sliding for block in model.blocks}
        window = model.config.sliding_window or None
        cached: list[int] = []  # the tokens whose keys/values row 0 of the cache holds, from slot 0
        try:
            for batch, (shared, ids, positions, branch, picks) in zip(batches, plans):
                keep = 0
                while keep < min(len(cached), len(shared)) and cached[keep] == shared[keep]:
                    keep += 1
                if keep < len(shared):
                    model.forward_hidden(torch.tensor([shared[keep:]], device=self._device),
                                         input_pos=torch.arange(keep, len(shared), device=self._device))
                for cache in caches:
                    cache.k[1:len(batch), :, :len(shared)] = cache.k[:1, :, :len(shared)]
                    cache.v[1:len(batch), :, :len(shared)] = cache.v[:1, :, :len(shared)]
                slots = len(shared) + ids.size(1)
                masks = {sliding: _tree_mask(len(shared), positions, branch, window if sliding else None,
                                             model.max_cache_len).to(self._device) for sliding in kinds}
                hidden = model.forward_hidden(ids.to(self._device),
                                              input_pos=torch.arange(len(shared), slots, device=self._device),
                                              positions=positions.to(self._device), masks=masks)
                self._score([hidden[row, index] for row, index in picks],
                            [(i, list(pairs[i][1])) for _, members in batch for i in members], results)
                cached = shared  # row 0 beyond the shared prefix now holds this batch's first row
                bar.update()
        finally:
            model.clear_kv_cache()

    def _tree_plan(self, batch: list[Tree], pairs: Sequence[Pair]):
        """A batch's layout: the prefix its contexts share less their last tokens; each row's tokens (the rest of
        its context, then its continuations less their last tokens), their positions and branch (0: the context;
        j: continuation j; -1: padding), right-padded to one length; per member, (row, indices of the hidden states
        that predict its continuation)."""
        contexts = [context for context, _ in batch]
        shared = _shared_prefix(contexts)
        rows, picks = [], []
        for r, (context, members) in enumerate(batch):
            tokens = list(context[shared:])
            positions = list(range(shared, len(context)))
            branch = [0] * len(tokens)
            for j, i in enumerate(members, 1):
                cont = pairs[i][1][:-1]
                picks.append((r, torch.tensor([len(context) - shared - 1, *range(len(tokens), len(tokens) + len(cont))])))
                tokens += cont
                positions += range(len(context), len(context) + len(cont))
                branch += [j] * len(cont)
            rows.append((tokens, positions, branch))
        width = max(len(tokens) for tokens, _, _ in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        pos = torch.zeros(len(rows), width, dtype=torch.long)
        branch = torch.full((len(rows), width), -1, dtype=torch.long)
        for r, (tokens, positions, branches) in enumerate(rows):
            ids[r, :len(tokens)] = torch.tensor(tokens)
            pos[r, :len(tokens)] = torch.tensor(positions)
            branch[r, :len(tokens)] = torch.tensor(branches)
        return contexts[0][:shared], ids, pos, branch, picks

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(*req.args) for req in requests]
        results = self.loglikelihood_tokens(pairs, disable_tqdm)
        for req, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        pairs: list[Pair] = []
        owners: list[int] = []
        for r, req in enumerate(requests):
            (text,) = req.args
            windows = rolling_windows(self.tokenizer.encode(text, bos=False), self.prefix_token_id, self.max_length)
            pairs += windows
            owners += [r] * len(windows)
        totals = [0.0] * len(requests)
        for r, (logprob, _) in zip(owners, self.loglikelihood_tokens(pairs, disable_tqdm)):
            totals[r] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation --------------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        outputs = []
        for req in tqdm(requests, disable=disable_tqdm, desc="generate_until"):
            context, gen_kwargs = req.args
            kwargs = dict(gen_kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0) if kwargs.pop("do_sample", False) else 0.0
            budget = self.max_length - max_new
            if budget < 1:
                raise InvalidInput(f"max_gen_toks={max_new} leaves no room for a prompt in max_length "
                                   f"{self.max_length} (the model's context): choose another task or model")
            prompt = self.tokenizer.encode(context)[-budget:]
            tokens: list[int] = []
            text = ""
            for token in generate(self.model, prompt, max_new, temperature=temperature,
                                  stop_ids=self.tokenizer.eos_ids):
                tokens.append(token)
                text = self.tokenizer.decode(tokens)
                cut = first_stop(text, until)
                if cut is not None:
                    text = text[:cut]
                    break
            self.cache_hook.add_partial("generate_until", req.args, text)
            outputs.append(text)
        return outputs

    def get_model_info(self) -> dict[str, Any]:
        """Merged into lm-eval's results["config"]."""
        return {"model_name": str(self.tokenizer.checkpoint_dir), "max_length": self.max_length,
                "model_dtype": str(self.model.lm_head.weight.dtype).replace("torch.", "")}

"""Continuous batching (lit_qlora.model.batch_decode): every row answers as `generate` does alone, whatever joins or
leaves around it; the shared cache grows and compacts without disturbing the rows it holds."""

import pytest
import torch

from lit_qlora.base.errors import InvalidInput
from lit_qlora.model.attention_mask import attention_mask
from lit_qlora.model.batch_decode import DecodeBatch, Row
from lit_qlora.model.config import Config
from lit_qlora.model.sampling import generate
from lit_qlora.model.transformer import Transformer
from lit_qlora.nf4 import quantize_linears

from helpers import rows_of, run_batch as run


def tiny_model(**changes):
    torch.manual_seed(0)
    settings = dict(vocab_size=96, n_layer=2, n_embd=64, n_head=4, n_query_groups=2, intermediate_size=128,
                    max_seq_length=160, tie_embeddings=False)
    model = Transformer(Config(**{**settings, **changes}))
    model.init_weights(std=0.3)  # peaked logits: greedy tokens far from ties
    return model.eval()


def alone(model, row: Row) -> list[int]:
    return list(generate(model, row.prompt, row.limit, row.temperature, row.top_k, tuple(row.stop_ids), row.seed,
                         row.top_p))


def test_rows_joining_at_different_steps_answer_as_each_does_alone():
    model = tiny_model()
    prompts = [[3, 9, 27, 81, 5], [7, 1], list(range(10, 50)), [60, 61, 62], [4] * 70, [11, 12, 13, 14]]
    rows = rows_of(prompts, limit=[12, 30, 7, 20, 65, 1], temperature=[0, 0.9, 0, 1.3, 0.7, 0],
                   top_p=[None, 0.8, None, None, 0.95, None], top_k=[None, None, None, 5, None, None],
                   seed=[1, 2, 3, 4, 5, 6])
    expected = {row.key: alone(model, row) for row in rows}
    batch = DecodeBatch(model)
    tokens, finish, widest = run(batch, {0: rows[:2], 3: rows[2:4], 4: rows[4:5], 9: rows[5:]})
    assert tokens == expected
    assert widest >= 4
    for row in rows:
        assert finish[row.key] == ("length" if len(expected[row.key]) == row.limit else "stop")
    assert batch.rows == [] and batch.capacity == (0, 0)  # the cache is freed when the last row leaves
    assert all(block.self_attn.kv_cache is None for block in model.model.layers)
    assert batch.model.max_cache_len == 0


def test_stop_ids_end_a_row_without_yielding_them():
    model = tiny_model()
    free = alone(model, Row("x", [5, 6, 7], 20))
    stop = free[4]
    row = Row("x", [5, 6, 7], 20, stop_ids=frozenset({stop}))
    tokens, finish, _ = run(DecodeBatch(model), {0: [row, Row("y", [8, 9], 20)]})
    assert tokens["x"] == free[: free.index(stop)] and finish["x"] == "stop"


@pytest.mark.parametrize("kind", ["nf4", "sliding"])
def test_nf4_bases_and_sliding_windows_batch_as_they_decode_alone(kind):
    model = tiny_model(**({"sliding_window": 6} if kind == "sliding" else {}))
    if kind == "nf4":
        quantize_linears(model)
    rows = rows_of([[3, 9, 27, 81, 5, 6, 7, 8], [7, 1], [40, 41, 42]], limit=[15, 9, 20], temperature=0.0)
    expected = {row.key: alone(model, row) for row in rows}
    tokens, _, _ = run(DecodeBatch(model), {0: rows[:1], 2: rows[1:]})
    assert tokens == expected


def test_a_dropped_row_frees_its_place_and_the_others_go_on():
    model = tiny_model()
    rows = rows_of([[3, 9, 27], [7, 1, 2, 3, 4, 5], [40, 41]], limit=25, temperature=0.0)
    expected = {row.key: alone(model, row) for row in rows}
    batch = DecodeBatch(model)
    for row in rows:
        batch.add(row)
    got = {row.key: [] for row in rows}
    while len(got["r0"]) < 3:
        for t in batch.step():
            got[t.key].append(t.token)
    batch.drop("r0")  # the first row leaves: the last moves into its cache row
    assert [row.key for row in batch.rows] == ["r2", "r1"]
    while batch.rows:
        for t in batch.step():
            got[t.key].append(t.token)
    assert got["r1"] == expected["r1"] and got["r2"] == expected["r2"]
    assert got["r0"] == expected["r0"][:3]


def test_the_cache_doubles_as_rows_join_and_lengthen():
    model = tiny_model()
    batch = DecodeBatch(model)
    batch.add(Row("a", [1, 2, 3], 100))
    assert batch.capacity == (1, 64)
    batch.add(Row("b", [4, 5], 100))
    batch.add(Row("c", [6], 100))
    assert batch.capacity == (4, 64)
    for _ in range(70):
        batch.step()
    assert batch.capacity == (4, 128)  # row a stands at 73 positions
    assert batch.views[0].whole_k.shape[:3] == (4, 2, 128)


def test_a_row_that_cannot_fit_is_refused_before_it_joins():
    model = tiny_model()
    batch = DecodeBatch(model)
    with pytest.raises(InvalidInput, match="context"):
        batch.add(Row("a", list(range(100)), 61))
    with pytest.raises(InvalidInput, match="at least one"):
        batch.add(Row("a", [1], 0))
    assert batch.rows == []


def test_the_mask_of_rows_at_their_own_positions():
    q = torch.tensor([[2], [4]])
    mask = attention_mask(q, 6, None, True)
    assert mask.shape == (2, 1, 1, 6)
    assert mask[:, 0, 0].tolist() == [[True] * 3 + [False] * 3, [True] * 5 + [False]]
    windowed = attention_mask(q, 6, 2, True)
    assert windowed[:, 0, 0].tolist() == [[False, True, True, False, False, False],
                                         [False, False, False, True, True, False]]


def test_a_prompt_that_starts_as_a_recent_one_prefills_only_the_rest():
    """A shared prefix (a system prompt) is computed once: the next prompt copies its keys and values and prefills
    the rest; its logits equal a whole prefill's and it answers as alone. Another adapter's prompts, a short match,
    and an adapter forgotten do not reuse."""
    model = tiny_model()
    system = [7, 3, 11, 19, 23, 5, 60, 61, 62, 63, 2, 4]
    first, second = Row("a", system + [30, 31, 32], 12), Row("b", system + [40, 41], 12)
    batch = DecodeBatch(model, min_reuse=8)
    got = {"a": [], "b": []}

    def step():
        for t in batch.step():
            got[t.key] += [t.token] if t.token is not None else []

    batch.add(first)
    step()  # its prompt fed: its keys and values kept
    batch.add(second)
    step()
    assert (first.reused, second.reused) == (0, len(system))
    whole = DecodeBatch(model, prefix_bytes=0)
    twin = Row("b", second.prompt, 12)
    whole.add(twin)
    whole.step()
    assert twin.reused == 0
    torch.testing.assert_close(second.logits, twin.logits, rtol=1e-5, atol=1e-5)
    whole.release()
    while batch.rows:
        step()
    assert got["b"] == alone(model, Row("b", second.prompt, 12))
    assert got["a"] == alone(model, Row("a", first.prompt, 12))
    other = Row("c", system + [50], 12, adapter=1)
    batch.add(other)
    assert other.reused == 0  # the adapter's own keys and values differ
    short = Row("d", system[:5] + [1, 2, 3], 12)
    batch.add(short)
    assert short.reused == 0  # five shared tokens: under min_reuse
    same = Row("s", second.prompt, 12)
    batch.add(same)
    assert same.reused == len(second.prompt) - 1 and same.feed == second.prompt[-1:]  # no prefill: its last token
    batch.prefixes.forget(0)
    again = Row("e", system + [30, 31, 32], 12)
    batch.add(again)
    assert again.reused == 0

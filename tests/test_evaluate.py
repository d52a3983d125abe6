"""lm-eval adapter and `litqlora evaluate`: exact log-likelihoods, lm-eval's tokenization and rolling-window
conventions, stop strings, offline TruthfulQA on the real SmolLM2, adapters, and clear errors."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from lit_qlora.checkpoint.hf import load_checkpoint
from lit_qlora.eval import SAMPLE_DATA_FILE, TASKS_DIR
from lit_qlora.eval.evaluate import check_task_names
from lit_qlora.eval.lm import LitQLoRALM, rolling_windows
from lit_qlora.eval.truthfulqa import check_truthfulqa_file
from lit_qlora.checkpoint.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "eval" / "data" / "truthfulqa_mc_sample.jsonl"


def instances(kind: str, args: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir, dtype=torch.float32).eval(), Tokenizer(tiny_llama_dir)


def direct(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """Sum of log-softmax over the continuation tokens of one unbatched, uncached forward pass."""
    tokens = context + continuation
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]]))[0].float()
    rows = logits[len(context) - 1:]
    target = torch.tensor(continuation)
    logprob = rows.log_softmax(-1).gather(-1, target[:, None]).sum().item()
    return logprob, bool((rows.argmax(-1) == target).all())


REQUESTS = [
    ("Q: What is the capital of France?\nA:", " Paris."),
    ("Q: What is the capital of France?\nA:", " Lyon, which is a large city."),
    ("Q: What is the capital of France?\nA: ", "Marseille."),  # trailing space moves to the continuation
    ("", "Once upon a time"),  # empty context: conditioned on the prefix token
    ("The quick brown fox", " jumps over the lazy dog and keeps running far away"),
    ("Q: What is the capital of France?\nA:", " Paris."),  # duplicate
    ("Short", " one"),
    ("Q: What is the capital of Italy?\nA:", " Rome."),  # reuses the cached prefix "Q: What is the capital of"
    ("Q: What is the capital of Italy?\nA:", " Milan, in the north."),
]


def test_encode_pair_follows_lm_eval_convention(tiny):
    model, tok = tiny
    lm = LitQLoRALM(model, tok)
    ctx, cont = lm.encode_pair("Q: 2+2?\nA:", " 4")
    assert ctx == tok.encode("Q: 2+2?\nA:") and ctx + cont == tok.encode("Q: 2+2?\nA: 4")
    assert lm.encode_pair("Q: 2+2?\nA: ", "4") == (ctx, cont)  # whitespace attaches to the continuation
    assert lm.encode_pair("", "Hello") == ([tok.bos_id], tok.encode("Hello", bos=False))
    # A BOS-adding family (Llama): the context starts with one BOS, the continuation never has one.
    llama_style = Tokenizer(tok.checkpoint_dir)
    llama_style.add_bos = True
    lm = LitQLoRALM(model, llama_style)
    ctx_bos, cont_bos = lm.encode_pair("Q: 2+2?\nA:", " 4")
    assert ctx_bos == [tok.bos_id] + ctx and cont_bos == cont
    assert lm.encode_pair("", "Hello") == ([tok.bos_id], tok.encode("Hello", bos=False))


@pytest.mark.parametrize("batch_size,share", [(3, True), (2, False), (1, True)])
def test_loglikelihood_equals_direct_computation_in_request_order(tiny, batch_size, share):
    model, tok = tiny
    lm = LitQLoRALM(model, tok, batch_size=batch_size, share_context=share)
    order = list(range(len(REQUESTS)))
    random.Random(batch_size).shuffle(order)
    requests = [REQUESTS[i] for i in order]
    got = lm.loglikelihood(instances("loglikelihood", requests), disable_tqdm=True)
    for (context, continuation), (logprob, greedy) in zip(requests, got):
        want_logprob, want_greedy = direct(model, *lm.encode_pair(context, continuation))
        assert logprob == pytest.approx(want_logprob, abs=1e-4)
        assert greedy == want_greedy


def test_greedy_flag_is_exact(tiny):
    model, tok = tiny
    lm = LitQLoRALM(model, tok, batch_size=4)
    context = tok.encode("Tell me a story about a dragon")
    greedy = []
    with torch.no_grad():
        for _ in range(6):
            greedy.append(int(model(torch.tensor([context + greedy]))[0, -1].argmax()))
    other = greedy[:3] + [(greedy[3] + 1) % tok.vocab_size] + greedy[4:]
    # Shared context: both run as one group on the KV cache; the plain path gets a second copy of each.
    results = lm.loglikelihood_tokens([(context, greedy), (context, other), (context, greedy[:1])])
    assert [g for _, g in results] == [True, False, True]
    assert results[0][0] == pytest.approx(direct(model, context, greedy)[0], abs=1e-4)
    assert results[1][0] == pytest.approx(direct(model, context, other)[0], abs=1e-4)


@pytest.mark.parametrize("n", [1, 5, 8, 9, 23])
def test_rolling_windows_match_lm_eval(n):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    tokens = list(range(100, 100 + n))
    theirs = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, 7, 8, 1)]
    assert rolling_windows(tokens, 7, 8) == [(list(a), list(b)) for a, b in theirs]


def test_loglikelihood_rolling_sums_windows(tiny):
    model, tok = tiny
    text = "The rain in Spain stays mainly in the plain. " * 4
    tokens = tok.encode(text, bos=False)
    assert len(tokens) > 3 * 10
    lm = LitQLoRALM(model, tok, batch_size=2, max_length=10)
    windows = rolling_windows(tokens, tok.bos_id, 10)
    assert len(windows) == math.ceil(len(tokens) / 10) and all(len(c) + len(p) <= 11 for c, p in windows)
    want = sum(direct(model, c, p)[0] for c, p in windows)
    short, long_ = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [("Hi there",), (text,)]),
                                            disable_tqdm=True)
    assert long_ == pytest.approx(want, abs=1e-3)
    assert short == pytest.approx(direct(model, [tok.bos_id], tok.encode("Hi there", bos=False))[0], abs=1e-4)
    # With room for the whole text it is one window: the plain log-likelihood after the prefix token.
    whole = LitQLoRALM(model, tok).loglikelihood_rolling(instances("loglikelihood_rolling", [(text,)]),
                                                         disable_tqdm=True)
    assert whole[0] == pytest.approx(direct(model, [tok.bos_id], tokens)[0], abs=1e-3)


def test_generate_until_stops_at_stop_strings(tiny):
    model, tok = tiny
    lm = LitQLoRALM(model, tok)
    context = "Write a poem about the sea"
    (free,) = lm.generate_until(instances("generate_until", [(context, {"max_gen_toks": 24})]), disable_tqdm=True)
    assert len(tok.encode(free, bos=False)) <= 24 and len(free) > 6
    stop = free[4:7]
    cut, cut_str = lm.generate_until(instances("generate_until", [
        (context, {"until": [stop, "never-appears"], "max_gen_toks": 24}),
        (context, {"until": stop, "max_gen_toks": 24, "do_sample": False}),
    ]), disable_tqdm=True)
    assert cut == cut_str == free[:free.find(stop)]
    (short,) = lm.generate_until(instances("generate_until", [(context, {"max_gen_toks": 3})]), disable_tqdm=True)
    assert free.startswith(short) and len(tok.encode(short, bos=False)) <= 3


def test_sample_file_and_task_yamls():
    assert check_truthfulqa_file(SAMPLE) == 20
    assert SAMPLE_DATA_FILE.resolve() == SAMPLE.resolve()  # eval/ is the installed lit_qlora.eval package
    from lm_eval.tasks._yaml_loader import load_yaml
    import lm_eval

    upstream = Path(lm_eval.__file__).parent / "tasks" / "truthfulqa"
    for name in ("truthfulqa_mc1", "truthfulqa_mc2"):
        ours = load_yaml(TASKS_DIR / f"{name}.yaml", resolve_func=False)
        theirs = load_yaml(upstream / f"{name}.yaml", resolve_func=False)
        for key in ("task", "doc_to_text", "doc_to_choice", "doc_to_target", "num_fewshot", "metric_list",
                    "metadata", "output_type", "validation_split"):
            assert ours[key] == theirs[key], (name, key)
        # mc2's scoring hook has the same name, in our utils.py instead of lm-eval's (which needs sacrebleu).
        assert Path(str(ours.get("process_results"))).name == Path(str(theirs.get("process_results"))).name


def test_mc2_score_is_normalized_true_mass():
    from lit_qlora.eval.tasks.utils import mc2_score, process_results_mc2

    ll = [-1.0, -2.0, -0.5, -3.0]
    p = [math.exp(x) for x in ll]
    assert mc2_score(ll, [1, 1, 0, 0]) == pytest.approx((p[0] + p[1]) / sum(p))
    doc = {"mc2_targets": {"labels": [0, 1]}}
    assert process_results_mc2(doc, [(-900.0, False), (-901.0, False)])["acc"] == pytest.approx(
        math.exp(-1) / (1 + math.exp(-1)))  # no underflow where exp(ll) is 0.0


def test_unknown_task_lists_close_matches():
    with pytest.raises(ValueError, match="did you mean truthfulqa_mc2"):
        check_task_names(["truthfulqa_mc3"], ["truthfulqa_mc1", "truthfulqa_mc2", "hellaswag"])
    check_task_names(["hellaswag"], ["hellaswag"])


def bad_rows():
    good = json.loads(SAMPLE.read_text().splitlines()[0])
    yield "missing mc2_targets", {k: v for k, v in good.items() if k != "mc2_targets"}, "mc2_targets"
    yield "labels of wrong length", {**good, "mc1_targets": {"choices": ["a", "b"], "labels": [1]}}, "mc1_targets"
    yield "string labels", {**good, "mc2_targets": {"choices": ["a"], "labels": ["1"]}}, "mc2_targets.labels"
    yield "question not a string", {**good, "question": 3}, "question"
    yield "mc1 answer not first", {**good, "mc1_targets": {"choices": ["a", "b"], "labels": [0, 1]}}, "mc1_targets"


@pytest.mark.parametrize("case", list(bad_rows()), ids=lambda c: c[0])
def test_bad_data_file_is_one_clear_error(tmp_path, case, capsys):
    from lit_qlora.cli import main

    _, row, mentioned = case
    path = tmp_path / "bad.jsonl"
    path.write_text(SAMPLE.read_text().splitlines()[0] + "\n\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError) as e:
        check_truthfulqa_file(path)
    message = str(e.value)
    assert str(path) in message and "row 2 (line 3)" in message and mentioned in message
    if case[0] == "missing mc2_targets":  # the CLI: one line, exit 1, before any model loads
        with pytest.raises(SystemExit) as exit_:
            main(["evaluate", "--checkpoint_dir", str(tmp_path), "--tasks", "truthfulqa_mc2",
                  "--data_file", str(path)])
        assert exit_.value.code == 1


@pytest.mark.slow
def test_evaluate_smollm2_truthfulqa_mc2(smollm2_dir, tmp_path):
    from lit_qlora.cli import main
    from lit_qlora.eval.tasks.utils import mc2_score

    out = tmp_path / "eval"
    main(["evaluate", "--checkpoint_dir", str(smollm2_dir), "--tasks", "truthfulqa_mc2", "--data_file", str(SAMPLE),
          "--limit", "8", "--precision", "32-true", "--out_dir", str(out)])
    results = json.loads((out / "results.json").read_text())
    acc = results["results"]["truthfulqa_mc2"]["acc,none"]
    assert isinstance(acc, float) and 0.0 <= acc <= 1.0
    assert results["n-samples"]["truthfulqa_mc2"]["effective"] == 8
    info = results["lit_qlora"]
    assert info["quantize"] == "none" and info["precision"] == "32-true" and info["tasks"] == ["truthfulqa_mc2"]
    assert info["limit"] == 8 and info["wall_seconds"] > 0 and info["peak_memory_bytes"] > 0
    assert "truthfulqa_mc2" in results["configs"]

    samples = [json.loads(line) for line in (out / "samples_truthfulqa_mc2.jsonl").read_text().splitlines()]
    assert len(samples) == 8
    first = min(samples, key=lambda s: s["doc_id"])
    lls = [float(r[0][0]) for r in first["resps"]]
    labels = first["doc"]["mc2_targets"]["labels"]
    p = [math.exp(x) for x in lls]
    hand = sum(pi for pi, label in zip(p, labels) if label == 1) / sum(p)
    assert first["acc"] == pytest.approx(hand, rel=1e-9) == pytest.approx(mc2_score(lls, labels), rel=1e-9)
    assert acc == pytest.approx(sum(s["acc"] for s in samples) / 8)
    # Those log-likelihoods are the model's: recompute one choice directly (whole sequences, no cache). In
    # float32: bf16 sums over a 200-token prompt move by a few tenths of a nat with the batch shape alone.
    model = load_checkpoint(smollm2_dir, dtype=torch.float32).eval()
    lm = LitQLoRALM(model, Tokenizer(smollm2_dir))
    (context, continuation), ll = first["arguments"][-1], lls[-1]
    assert direct(model, *lm.encode_pair(context, continuation))[0] == pytest.approx(ll, abs=2e-3)


def test_evaluate_with_adapter_and_parquet(tiny_llama_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lit_qlora.eval.evaluate import evaluate
    from lit_qlora.lora.layer import apply_lora
    from lit_qlora.checkpoint.adapter import save_adapter
    from lit_qlora.checkpoint.loading import load_model

    model = load_model(tiny_llama_dir, "nf4")
    apply_lora(model, r=4, alpha=8, targets="all", dtype=torch.bfloat16)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(p, std=0.5)
    adapter = save_adapter(model, tmp_path / "adapter", {
        "r": 4, "alpha": 8, "targets": ["all"], "rslora": False, "quantize": "nf4",
        "base_dtype": "bfloat16", "lora_dtype": "bfloat16"})
    parquet = tmp_path / "tqa.parquet"
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), parquet)

    common = dict(checkpoint_dir=tiny_llama_dir, tasks="truthfulqa_mc1,truthfulqa_mc2", data_file=parquet, limit=3)
    adapted = evaluate(adapter_dir=adapter, out_dir=tmp_path / "a", **common)
    assert adapted["lit_qlora"]["quantize"] == "nf4"  # defaulted from adapter_config.json
    assert adapted["lit_qlora"]["adapter_dir"] == str(adapter.resolve())
    for task in ("truthfulqa_mc1", "truthfulqa_mc2"):
        assert 0.0 <= adapted["results"][task]["acc,none"] <= 1.0
    base = evaluate(quantize="nf4", out_dir=tmp_path / "b", **common)
    assert base["lit_qlora"]["adapter_dir"] is None
    assert adapted["results"]["truthfulqa_mc2"]["acc,none"] != base["results"]["truthfulqa_mc2"]["acc,none"]
    assert json.loads((tmp_path / "a" / "results.json").read_text())["lit_qlora"]["quantize"] == "nf4"


@pytest.mark.parametrize("family", ["mistral-sliding-window", "gemma3-local-rope-scaled", "phi3-partial-longrope"])
def test_choices_scored_as_branches_of_one_row_equal_each_sequence_alone(family):
    """Requests that share a context run as a tree (the context once, each continuation a branch on it): with
    sliding windows shorter than the context (Mistral; Gemma 3's sliding and full blocks, each kind its own mask),
    contexts sharing a prefix and contexts that share nothing in one batch, and a group too long for one row
    (max_length 24: split into rows). Phi-3's long RoPE has no single length for a tree: its requests run whole.
    Every answer equals one uncached forward of its own sequence."""
    import types

    from helpers import FAMILY_CASES, reference_and_ours

    _, model, _ = reference_and_ours(*FAMILY_CASES[family])
    model = model.float().eval()
    gen = random.Random(7)
    preamble = [gen.randrange(3, 97) for _ in range(9)]
    contexts = [preamble + [5, 6], preamble + [7], [8, 9, 10, 11, 12, 13, 14], preamble + [5, 6, 20, 21]]
    pairs = []
    for c, context in enumerate(contexts):
        for _ in range(3 if c != 3 else 7):
            pairs.append((context, [gen.randrange(3, 97) for _ in range(gen.randint(1, 6) if c != 3 else 5)]))
    gen.shuffle(pairs)
    tokenizer = types.SimpleNamespace(bos_id=1, eos_id=2, checkpoint_dir="tiny")
    # (Phi-3 one sequence a batch: its RoPE factors follow a batch's padded length, as transformers' do)
    lm = LitQLoRALM(model, tokenizer, batch_size=1 if family.startswith("phi3") else 2, max_length=24)
    trees = []
    real = model.forward_hidden

    def counted(*args, **kwargs):
        trees.append(kwargs.get("masks") is not None)
        return real(*args, **kwargs)

    model.forward_hidden = counted
    got = lm.loglikelihood_tokens(pairs)
    model.forward_hidden = real
    for (context, continuation), (logprob, greedy) in zip(pairs, got):
        want_logprob, want_greedy = direct(model, context, continuation)
        assert logprob == pytest.approx(want_logprob, abs=1e-4)
        assert greedy == want_greedy
    if family.startswith("phi3"):
        assert not any(trees) and len(trees) == len(pairs)
    else:
        batches = lm._tree_batches({tuple(c): [i for i, p in enumerate(pairs) if p[0] == c] for c in contexts}, pairs)
        rows = [len(members) for batch in batches for _, members in batch]
        assert sum(rows) == len(pairs) and len(rows) == 5  # the 7 continuations of the last context in two rows
        assert sum(trees) == len(batches) < len(rows)  # one forward a batch, rows of different contexts in one
        for batch in batches:  # a forward's tokens within batch_size (2) of the batch's longest sequences
            longest = max(len(c) + max(len(pairs[i][1]) for i in m) for c, m in batch)
            assert len(batch) == 1 or lm._tree_tokens(batch, pairs) <= 2 * longest

